"""The transport helpers (batch, put, stream) on this machine, the one-round-trip status merge (and an
unreachable cluster in status and --watch), the log printer, the registry's profile column and array
lookups: no cluster needed."""

from __future__ import annotations

import io
import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from meshrun.submit import api
from meshrun.submit.core.registry import JobRecord, Registry
from meshrun.submit.core.state import JobState
from meshrun.submit.core.status import parse_metrics_tail
from meshrun.submit.errors import HostKeyChanged, InputError, JobNotFound
from meshrun.submit.schedulers import slurm_cli as slurm
from meshrun.submit.schedulers.slurm import query_argvs, states_from
from meshrun.submit.transport.base import LocalTransport, Result, Upload, batch, tar_bytes
from meshrun.submit.views.logs import Printer, Source, parse_ranks, print_once
from tests.helpers import builders
from tests.helpers.builders import hostile


def test_batch_keeps_each_commands_output_code_and_quotes_everything(canary: Path) -> None:
    HOSTILE = hostile(canary)
    out = batch(
        LocalTransport(),
        [["printf", "%s", HOSTILE], ["sh", "-c", "echo out; echo err >&2; exit 3"], ["printf", "a\n\nb\n"], ["true"]],
    )
    assert [(r.returncode, r.stdout, r.stderr) for r in out] == [
        (0, HOSTILE, ""),
        (3, "out\n", "err\n"),
        (0, "a\n\nb\n", ""),
        (0, "", ""),
    ]
    assert not canary.exists()


def test_put_writes_modes_folders_and_runs_then(tmp_path: Path) -> None:
    HOSTILE = hostile(tmp_path / "pwned")
    files = {
        "a/b.txt": Upload(b"hi"),
        "run.sh": Upload(b"#!/bin/sh\n", 0o700),
        "logs/": Upload(b"", 0o700),
        HOSTILE: Upload(b"odd"),
    }
    done = LocalTransport().put(files, str(tmp_path / "d"), then=["ls", str(tmp_path / "d")])
    assert done is not None and "logs" in done.stdout.split()
    assert (tmp_path / "d" / HOSTILE).read_bytes() == b"odd"
    assert (tmp_path / "d" / "run.sh").stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "d").stat().st_mode & 0o777 == 0o700
    assert not (tmp_path / "pwned").exists()


def test_the_ssh_put_script_unpacks_the_same_tar(tmp_path: Path) -> None:
    from meshrun.submit.transport.base import PUT_SCRIPT

    HOSTILE = hostile(tmp_path / "pwned")
    files = {"a/b.txt": Upload(b"hi"), "x/": Upload(b"", 0o700), HOSTILE: Upload(b"odd", 0o600)}
    done = LocalTransport().run(
        ["sh", "-c", PUT_SCRIPT, "sh", str(tmp_path / "d"), "cat", str(tmp_path / "d/a/b.txt")], stdin=tar_bytes(files)
    )
    assert done.returncode == 0 and done.stdout == "hi", done.stderr
    assert (tmp_path / "d" / HOSTILE).read_bytes() == b"odd" and (tmp_path / "d" / "x").is_dir()
    assert not (tmp_path / "pwned").exists()


def test_one_round_trip_queries_squeue_sacct_and_every_metrics_tail() -> None:
    argvs = query_argvs([builders.record("1", run_dir="/r/1"), builders.record("2_3", run_dir="/r/2_3")])
    assert argvs[0][:4] == ["squeue", "--noheader", "--array", "--states=all"] and argvs[1][0] == "sacct"
    assert argvs[2:4] == [
        ["tail", "-c", "8192", "--", "/r/1/metrics.jsonl"],
        ["tail", "-c", "8192", "--", "/r/2_3/metrics.jsonl"],
    ]
    assert argvs[4:] == [
        ["head", "-c", "500", "--", "/r/1/rank-error.txt"],
        ["head", "-c", "500", "--", "/r/2_3/rank-error.txt"],
    ]


def test_a_failed_slurm_job_says_why_in_the_ranks_words() -> None:
    from meshrun.submit.schedulers.slurm import _status
    from meshrun.submit.schedulers.slurm_cli import SlurmJob

    failed, ok = SlurmJob("1", JobState.FAILED, exit_code="2:0"), Result((), 0, "", "")
    error = Result((), 0, "rank 0: data.path: '/x': no token file there\n", "")
    found = _status(builders.record("1"), failed, ok, error)
    assert found.reason == "rank 0: data.path: '/x': no token file there" and found.exit_code == 2
    assert _status(builders.record("1"), failed, ok, Result((), 1, "", "No such file")).reason is None


def test_accounting_off_falls_back_to_squeue_and_the_last_seen_state() -> None:
    records = [builders.record("5"), builders.record("6", last_state="COMPLETED"), builders.record("7")]
    squeue = Result((), 0, "5|RUNNING|0:09|30:00|n1|None\n", "")
    sacct = Result((), 1, "", "sacct: error: Slurm accounting storage is disabled\n")
    states = states_from(records, squeue, sacct)
    assert [states[j].state for j in ("5", "6", "7")] == ["RUNNING", "COMPLETED", "UNKNOWN"]
    with pytest.raises(Exception, match="accounting storage is disabled"):
        states_from(records, Result((), 1, "", "slurm_load_jobs error: Unable to contact"), sacct)


class _Clusters:
    """Two clusters: one answers, the other presents a changed host key."""

    def __init__(self) -> None:
        self.changed = HostKeyChanged("WARNING: REMOTE HOST IDENTIFICATION HAS CHANGED for login.example")

    def transport_for(self, record: JobRecord) -> Any:
        if record.cluster == "bad":
            raise self.changed
        from meshrun.submit.transport.base import LocalTransport

        return LocalTransport()


def test_a_changed_host_key_reaches_the_person_not_only_json(tmp_path: Path) -> None:
    """A host key warning went only into --json output."""
    warned: list[str] = []
    records = [
        JobRecord("local-x", "ok", "n", str(tmp_path), "local", 0.0, None, "h"),
        JobRecord("7", "bad", "n", "/r", "slurm", 0.0, None, "h"),
    ]
    found = api.statuses(records, _Clusters(), warn=warned.append)
    assert [s.state for s in found] == ["UNKNOWN", "UNREACHABLE"]
    assert warned and "REMOTE HOST IDENTIFICATION HAS CHANGED" in warned[0] and warned[0].startswith("bad: ")


def test_watch_returns_when_only_unreachable_jobs_are_left(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """--watch never returned while a cluster was unreachable."""
    from meshrun.submit.cli import jobs as cli_jobs
    from meshrun.submit.core.status import Status

    lost = Status("7", "bad", "n", JobState.UNREACHABLE, "/r", 0.0, done=False, succeeded=False, reason="no route")
    done = Status("8", "ok", "n", JobState.COMPLETED, "/r", 0.0, done=True, succeeded=True)
    monkeypatch.setattr(api, "statuses", lambda records, clusters, registry=None, **how: [lost, done])
    assert cli_jobs.watch([], None, None, as_json=True) == 1
    assert "could not be reached" in capsys.readouterr().err


def test_metrics_tail_skips_a_line_being_written() -> None:
    assert parse_metrics_tail('{"step": 4, "loss": 2.5}\n{"step": 5, "lo') == {"step": 4, "loss": 2.5}
    assert parse_metrics_tail("") == {}


def test_merged_printer_prefixes_whole_lines_and_counts_bytes() -> None:
    out = io.BytesIO()
    printer, a, b = Printer(out, merged=True), Source("a", b"[rank 0] "), Source("b", b"[rank 1] ")
    for source, chunk in ((a, b"one\ntw"), (b, b"x\n"), (a, b"o\nthr"), (b, b"y")):
        printer.emit(source, chunk)
    printer.finish([a, b])
    assert out.getvalue() == b"[rank 0] one\n[rank 1] x\n[rank 0] two\n[rank 0] thr\n[rank 1] y\n"
    assert (a.offset, b.offset) == (11, 3)


def test_print_once_resumes_at_the_offset(tmp_path: Path) -> None:
    log = tmp_path / "rank-0.log"
    log.write_bytes(b"0123456789\xff\n")
    out, source = io.BytesIO(), Source(str(log), offset=4)
    print_once(LocalTransport(), [source], Printer(out, merged=False))
    assert out.getvalue() == b"456789\xff\n" and source.offset == log.stat().st_size


def test_rank_selection() -> None:
    assert parse_ranks("3", None) == [3] and parse_ranks("0,2", 4) == [0, 2] and parse_ranks("all", 3) == [0, 1, 2]
    for bad in ("x", "-1", "4"):
        with pytest.raises(InputError):
            parse_ranks(bad, 4)


def test_dependencies() -> None:
    assert slurm.dependency(["12", "any:13", "start:14_2"]) == "afterok:12,afterany:13,after:14_2"
    assert slurm.sbatch_argv("/s", "n", "/d", ["12"])[-2:] == ["--dependency=afterok:12", "/s"]
    for bad in ("$(x)", "maybe:12", "12;rm"):
        with pytest.raises(InputError, match="--after"):
            slurm.dependency([bad])


def test_registry_remembers_profiles_finds_arrays_and_migrates(tmp_path: Path) -> None:
    old = tmp_path / "old.sqlite"
    db = sqlite3.connect(old)  # a registry from before the profile column
    db.execute(
        "CREATE TABLE jobs (job_id TEXT NOT NULL, cluster TEXT NOT NULL, name TEXT NOT NULL, run_dir TEXT "
        "NOT NULL, scheduler TEXT NOT NULL, submitted_at REAL NOT NULL, git_sha TEXT, spec_hash TEXT NOT NULL,"
        " last_state TEXT NOT NULL DEFAULT 'SUBMITTED', PRIMARY KEY (cluster, job_id))"
    )
    db.execute("INSERT INTO jobs VALUES ('1','c','n','/r','slurm',1.0,NULL,'h','COMPLETED')")
    db.commit()
    db.close()
    reg = Registry(old)
    assert reg.find("1").profile is None and reg.find("1").last_state == "COMPLETED"
    for i in (10, 2, 0, 1):
        reg.add(JobRecord(f"40_{i}", "c", "n", f"/r/{i}", "slurm", 2.0, None, "h", profile="/p/c.yaml"))
    assert [r.job_id for r in reg.find_all("40")] == ["40_0", "40_1", "40_2", "40_10"]
    assert reg.find_all("40_2")[0].profile == "/p/c.yaml"
    with pytest.raises(JobNotFound):
        reg.find_all("4")


def test_both_transports_implement_the_whole_interface() -> None:
    from meshrun.submit.transport.base import Transport
    from meshrun.submit.transport.ssh import SshTransport

    wanted = {name for name in vars(Transport) if not name.startswith("_")}
    assert {"run", "put", "stream", "forward", "home"} <= wanted
    for cls in (LocalTransport, SshTransport):
        assert wanted <= set(dir(cls)), (cls, wanted - set(dir(cls)))


def test_new_caller_side_modules_stay_light() -> None:
    """paramiko loads only when a cluster needs SSH; tensorboard only on the login node."""
    import subprocess
    import sys

    code = (
        "import sys; import meshrun.submit.cli.main, meshrun.submit.cli.jobs, meshrun.submit.transport.snapshot, meshrun.submit.planning.sweep, meshrun.submit.core.status, "
        "meshrun.submit.views.logs, meshrun.submit.views.tensorboard, meshrun.submit.transport.sshconfig, meshrun.submit.views.progress, meshrun.submit.transport.portforward; "
        "bad = [m for m in ('torch', 'numpy', 'paramiko', 'tensorboard') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])


def test_metrics_tail_takes_the_step_line_and_the_newest_checkpoint() -> None:
    from meshrun.submit.core.status import parse_metrics_tail

    tail = (
        '{"step": 9, "loss": 2.5, "checkpoint_step": 5}\n'
        '{"step": 10, "loss": 2.4, "checkpoint_step": 5}\n'
        '{"event": "checkpoint", "checkpoint_step": 10, "time": 1}\n'
        '{"step": 11, "lo'
    )  # a line being written
    assert parse_metrics_tail(tail) == {"step": 10, "loss": 2.4, "checkpoint_step": 10}
    assert parse_metrics_tail('{"step": 1, "loss": 5.0}\n') == {"step": 1, "loss": 5.0}
    assert parse_metrics_tail("") == {}


def test_a_finished_jobs_tail_keeps_its_last_step_behind_the_sidecars_copy_events() -> None:
    """After the last step the sidecars append checkpoint events (staged, then copied, per save): the tail
    status reads (METRICS_TAIL_BYTES, as `tail -c` cuts it) still holds the step line and its restart."""
    from meshrun.submit.core.status import METRICS_TAIL_BYTES, parse_metrics_tail

    steps = [json.dumps({"step": s, "loss": 1.0, "restart_count": 1}) for s in range(1, 31)]
    events = [
        json.dumps({"event": "checkpoint", "checkpoint_step": s, kind: True})
        for s in (25, 30)
        for kind in ("staged", "copied")
    ]
    text = "\n".join(steps + events * 3) + "\n"
    tail = text.encode()[-METRICS_TAIL_BYTES:].decode()
    progress = parse_metrics_tail(tail)
    assert progress["step"] == 30 and progress["restart_count"] == 1 and progress["checkpoint_step"] == 30


def test_status_asks_the_scheduler_it_is_handed(tmp_path: Path) -> None:
    """core/status looks no backend up: each record's scheduler is asked through the lookup its caller gives."""
    from meshrun.submit.core.status import Status, statuses

    asked: list[tuple[str, list[str]]] = []

    class Reader:
        def __init__(self, name: str) -> None:
            self.name = name

        def statuses(self, records: Any, transport: Any, detail: bool = False, live: bool = False) -> list[Status]:
            asked.append((self.name, [r.job_id for r in records]))
            return [
                Status(r.job_id, r.cluster, r.name, JobState.RUNNING, r.run_dir, 0.0, False, False) for r in records
            ]

    records = [
        JobRecord("1", "ok", "n", "/r", "slurm", 0.0, None, "h"),
        JobRecord("x", "ok", "n", "/r", "local", 0, None, "h"),
    ]
    found = statuses(records, _Clusters(), Reader)
    assert asked == [("slurm", ["1"]), ("local", ["x"])] and [s.state for s in found] == [JobState.RUNNING] * 2


def test_a_job_known_to_have_ended_keeps_its_final_state_while_its_cluster_is_unreachable(tmp_path: Path) -> None:
    """A new user's report: with the testbed down, `status` showed jobs meshrun had seen end as UNREACHABLE,
    their step and loss blanked (watching.md: the last final state is kept)."""
    records = [
        JobRecord("local-x", "ok", "n", str(tmp_path), "local", 0.0, None, "h"),
        JobRecord("7", "bad", "n", "/r", "slurm", 0.0, None, "h", last_state="COMPLETED", last_progress='{"step": 9}'),
        JobRecord("8", "bad", "n", "/r", "slurm", 0.0, None, "h", last_state="RUNNING"),
    ]
    found = api.statuses(records, _Clusters(), warn=lambda _m: None)
    assert [s.state for s in found] == ["UNKNOWN", "COMPLETED", "UNREACHABLE"]
    assert found[1].done and found[1].succeeded and found[1].progress == {"step": 9}
    assert "REMOTE HOST IDENTIFICATION" in (found[2].reason or "")


def test_the_only_cluster_asked_unreachable_shows_the_ends_it_saw_and_says_why(tmp_path: Path) -> None:
    """A new user's trial: `status -c CLUSTER` with the cluster down showed nothing of jobs known to have ended."""
    warned: list[str] = []
    ended = JobRecord("7", "bad", "n", "/r", "slurm", 0.0, None, "h", last_state="FAILED", last_progress='{"step": 3}')
    running = JobRecord("8", "bad", "n", "/r", "slurm", 0.0, None, "h", last_state="RUNNING")
    found = api.statuses([ended, running], _Clusters(), warn=warned.append)
    assert [s.state for s in found] == ["FAILED", "UNREACHABLE"] and found[0].progress == {"step": 3}
    assert len(warned) == 1 and warned[0].startswith("bad: ")  # the one cluster asked: always said
    with pytest.raises(HostKeyChanged):  # nothing known to show: the error itself is the answer
        api.statuses([running], _Clusters(), warn=warned.append)


def test_an_unreachable_cluster_among_several_is_said_once_its_rows_being_what_status_saw_last(tmp_path: Path) -> None:
    """A new user's trial: with one cluster's Slurm not answering, the list showed its jobs' last RESTARTS as if
    read today, and said nothing (only a security problem or the one cluster asked was said)."""
    from meshrun.submit.errors import ClusterError

    class Down(_Clusters):
        def transport_for(self, record: JobRecord) -> Any:
            if record.cluster == "down":
                raise ClusterError("sacct and squeue failed (exit 1): Unable to contact slurm controller")
            return super().transport_for(record)

    warned: list[str] = []
    records = [
        JobRecord("local-x", "ok", "n", str(tmp_path), "local", 0.0, None, "h"),
        JobRecord("7", "down", "n", "/r", "slurm", 0.0, None, "h", last_state="COMPLETED"),
    ]
    found = api.statuses(records, Down(), warn=warned.append)
    assert [s.state for s in found] == ["UNKNOWN", "COMPLETED"]
    assert warned == [
        "down: sacct and squeue failed (exit 1): Unable to contact slurm controller (its jobs show what status saw last)"
    ]
