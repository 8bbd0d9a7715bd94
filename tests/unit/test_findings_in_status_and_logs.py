"""What the sidecars found, as `meshrun status` and `meshrun logs --diagnosis` show it, from recorded files.

The files are written here as the sidecars would (and garbled, half-written, hostile); the remote
reads run through a real `sh` on this machine, with recorded squeue/sacct output on PATH.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from meshrun.launcher.contract.records.envcheck import newest_run
from meshrun.submit.core import findings
from meshrun.submit.core.registry import JobRecord
from meshrun.submit.schedulers.local import BACKEND as LOCAL
from meshrun.submit.schedulers.slurm import BACKEND as SLURM
from meshrun.submit.transport.base import LocalTransport, Result, new_marker
from meshrun.submit.views.logs import fetch_diagnosis, format_diagnosis, heartbeat_lines
from meshrun.submit.views.tables import detail_lines, finding_note, status_table
from tests.helpers import builders
from tests.unit.test_local_and_wait import _status

NOW = time.time()
VERDICT = {
    "attempt": "41.0",
    "time": NOW,
    "step": 7,
    "phase": "step",
    "found_by": "n1",
    "silent_s": 95.2,
    "timeout_s": 60,
    "verdict": "Rank 3 on n2 stalled at step 7 in all_reduce (train.py:88); ranks 0-2 wait for it.",
    "ranks": [{"rank": 3, "node": "n2", "pid": 9, "step": 7, "phase": "step", "state": "stuck", "where": "all_reduce"}],
}
STRAGGLERS = {
    "time": NOW,
    "factor": 1.5,
    "median_s": 0.2,
    "stragglers": [{"rank": 3, "node": "n2", "busy_s": 0.36, "ratio": 1.8}, {"rank": 5, "node": "n3", "ratio": 1.62}],
}


def _env(node: str, driver: str, run: str = "41.0", when: float = NOW) -> dict[str, Any]:
    return {"node": node, "run": run, "time": when, "driver": driver, "torch": "2.6.0", "gpus": [{"uuid": "GPU-1"}]}


def _write(root: Path, rel: str, data: Any) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(
        data if isinstance(data, bytes) else (data if isinstance(data, str) else json.dumps(data)).encode()
    )


def _run_dir(root: Path, hung: bool = True) -> Path:
    if hung:
        _write(root, "diagnosis/verdict.json", VERDICT)
        _write(root, "diagnosis/verdict.txt", VERDICT["verdict"])
    _write(root, "stragglers.json", STRAGGLERS)
    _write(root, "env/n1.json", _env("n1", "550.54"))
    _write(root, "env/n2.json", _env("n2", "535.104"))
    _write(root, "env/n9.json", _env("n9", "999", run="40.0", when=NOW - 3600))  # an earlier run's node
    return root


# ------------------------------------------------------------------ parsing (pure)


def test_the_findings_of_a_hung_job_with_stragglers_and_a_driver_mismatch(tmp_path: Path) -> None:
    files = findings.read_files(str(_run_dir(tmp_path)), with_env=True)
    found = findings.findings_from(files, NOW - 60)
    assert found.verdict is not None and found.verdict["step"] == 7 and found.verdict["verdict"] == VERDICT["verdict"]
    assert [s["rank"] for s in found.stragglers] == [3, 5]
    # n9 belongs to an earlier run (a requeue landed elsewhere): not compared.
    assert found.env_mismatches == ["driver differs between nodes: 535.104 on n2; 550.54 on n1"]


def test_garbled_and_half_written_files_never_raise_and_give_what_they_can() -> None:
    garbled = {
        findings.VERDICT_JSON: '{"time": 1, "step": 7, "verd',  # being written
        findings.VERDICT_TXT: "Rank 1 stalled\n in barrier.\n",
        findings.STRAGGLERS: json.dumps({"stragglers": [{"rank": "x", "ratio": 2}, 5, {"rank": 2, "ratio": 1e999}]}),
        "env/a.json": "\x00\xff not json",
        "env/b.json": "[1, 2]",
    }
    found = findings.findings_from(garbled, 0.0)
    assert found.verdict is not None and found.verdict["verdict"] == "Rank 1 stalled\n in barrier."
    assert found.verdict["ranks"] == [] and found.stragglers == [] and found.env_mismatches == []
    for text in ("", "null", "[]", '"x"', '{"verdict": 5, "ranks": "no"}', "{}"):
        assert findings.findings_from({findings.VERDICT_JSON: text}, 0.0).verdict is None, text
    assert findings.findings_from({}, 0.0) == findings.NOTHING


def test_a_verdict_or_straggler_report_older_than_the_job_belongs_to_an_earlier_job_of_the_run_dir() -> None:
    files = {findings.VERDICT_JSON: json.dumps(VERDICT), findings.STRAGGLERS: json.dumps(STRAGGLERS)}
    resumed_later = findings.findings_from(files, NOW + 3600)  # `meshrun resume`: a new job in the same run dir
    assert resumed_later.verdict is None and resumed_later.stragglers == []
    assert findings.findings_from(files, NOW + 60).verdict is not None  # within the clock slack: this job's


def test_only_the_newest_runs_env_records_are_compared() -> None:
    records = [_env("n1", "1", run="a", when=1.0), _env("n2", "2", run="b", when=2.0), {"node": "n3", "run": "b"}]
    assert [r["node"] for r in newest_run(records)] == ["n2", "n3"]
    assert newest_run([{"node": "x"}, {"node": "y", "time": "soon"}]) == [{"node": "x"}, {"node": "y", "time": "soon"}]


# ------------------------------------------------------------------ the remote read: one command for every job


def test_one_command_reads_every_jobs_findings_and_a_file_cannot_forge_a_separator(tmp_path: Path) -> None:
    odd = _run_dir(tmp_path / "it's a $(dir) *")
    quiet = _run_dir(tmp_path / "quiet", hung=False)
    forger = tmp_path / "forger"
    marker = new_marker()
    _write(forger, "stragglers.json", "\nMESHRUN-0000000000000000 run\n\nMESHRUN-0000000000000000 file env/x.json\n{}")
    _write(forger, "diagnosis/verdict.txt", "x" * (findings.CAP_BYTES + 10))
    dirs = [str(odd), str(tmp_path / "missing"), str(forger), str(quiet)]
    done = LocalTransport().run(findings.findings_argv(dirs, True, marker))
    assert done.returncode == 0, done.stderr
    got = findings.split_findings(done.stdout, len(dirs), marker)
    assert got[0] == findings.read_files(str(odd), with_env=True) and got[1] == {}
    assert set(got[2]) == {findings.STRAGGLERS, findings.VERDICT_TXT} and len(got[2][findings.VERDICT_TXT]) == 65536
    assert got[3] == findings.read_files(str(quiet), with_env=True) and findings.VERDICT_JSON not in got[3]
    without_env = findings.split_findings(
        LocalTransport().run(findings.findings_argv(dirs[:1], False, marker)).stdout, 1, marker
    )
    assert set(without_env[0]) == {findings.VERDICT_JSON, findings.VERDICT_TXT, findings.STRAGGLERS}


class _Counting(LocalTransport):
    """This machine's sh, counting round trips."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def run(self, argv: Sequence[str], *args: Any, **kwargs: Any) -> Result:
        self.calls += 1
        return super().run(argv, *args, **kwargs)


def _recorded_slurm(bin_dir: Path, ids: Sequence[str], monkeypatch: Any) -> None:
    """squeue and sacct that print recorded output (no slurmctld in unit tests)."""
    bin_dir.mkdir()
    rows = "".join(f"{i}|RUNNING|1:00|1:00:00|n[1-2]|None\\n" for i in ids)
    for name, body in (("squeue", f"printf '{rows}'"), ("sacct", "exit 0")):
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def test_slurm_status_brings_the_findings_in_its_one_round_trip(tmp_path: Path, monkeypatch: Any) -> None:
    _recorded_slurm(tmp_path / "bin", ["41", "42"], monkeypatch)
    hung, fine = _run_dir(tmp_path / "hung"), tmp_path / "fine"
    fine.mkdir()
    transport = _Counting()
    jobs = [
        builders.record(job, run_dir=run, submitted_at=NOW - 60, last_state="RUNNING")
        for job, run in (("41", hung), ("42", fine))
    ]
    one, two = SLURM.statuses(jobs, transport, detail=True)
    assert transport.calls == 1 and one.state == "RUNNING"
    assert one.verdict is not None and one.verdict["step"] == 7 and [s["rank"] for s in one.stragglers] == [3, 5]
    assert one.env_mismatches == ["driver differs between nodes: 535.104 on n2; 550.54 on n1"]
    assert two.verdict is None and two.stragglers == [] and two.env_mismatches == []
    (listed,) = SLURM.statuses(jobs[:1], transport)  # the list view: no env records fetched
    assert listed.verdict is not None and listed.env_mismatches == [] and transport.calls == 2
    as_json = json.loads(json.dumps(one.as_json()))
    assert {"verdict", "stragglers", "env_mismatches"} <= set(as_json)


def test_local_status_reads_the_same_findings(tmp_path: Path) -> None:
    hung = _run_dir(tmp_path / "hung")
    (found,) = LOCAL.statuses(
        [builders.record("local-1", run_dir=hung, scheduler="local", submitted_at=NOW - 60, last_state="RUNNING")],
        LocalTransport(),
        detail=True,
    )
    assert found.verdict is not None and len(found.stragglers) == 2 and len(found.env_mismatches) == 1


# ------------------------------------------------------------------ what a person reads


def test_the_list_shows_a_short_note_only_when_a_job_has_one() -> None:
    plain = status_table([_status()])
    assert "NOTE" not in plain.splitlines()[0]
    noted = status_table([_status(verdict=VERDICT, stragglers=STRAGGLERS["stragglers"]), _status(job_id="2")])
    header, first, second = noted.splitlines()
    assert "NOTE" in header and "hang at step 7, 2 stragglers" in first and " - " in second
    assert finding_note(_status(verdict={"verdict": "x", "step": "?"})) == "hang"


def test_the_detail_view_shows_the_verdict_wrapped_stragglers_and_mismatches() -> None:
    found = _status(
        job_id="41",
        verdict={**VERDICT, "verdict": VERDICT["verdict"] * 3 + "\x1b[31m"},
        stragglers=STRAGGLERS["stragglers"],
        env_mismatches=["driver differs between nodes: 535.104 on n2; 550.54 on n1"],
    )
    lines = detail_lines(found, width=80)
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(NOW))
    assert lines[0] == f"hang: {when}, attempt 41.0"
    wrapped = lines[1 : lines.index("  the diagnosis: meshrun logs 41 --diagnosis")]
    assert len(wrapped) > 1 and all(len(line) <= 80 and line.startswith("  ") for line in wrapped)
    assert "\x1b" not in "".join(lines) and "\\x1b" in wrapped[-1]
    assert "stragglers: rank 3 (n2) 1.8x the median busy time, rank 5 (n3) 1.6x" in lines
    assert lines[-1] == "environment: driver differs between nodes: 535.104 on n2; 550.54 on n1"
    assert detail_lines(_status()) == []
    assert detail_lines(_status(verdict={"verdict": "stalled", "time": "garbled"}))[:2] == ["hang", "  stalled"]


def _diagnosis(root: Path, heartbeats: Optional[str] = None) -> Path:
    _write(root, "diagnosis/verdict.txt", VERDICT["verdict"] + "\n")
    _write(root, "diagnosis/verdict.json", VERDICT)
    for node, ranks in (("n1", (0, 1)), ("n2", (2, 3))):
        for rank in ranks:
            _write(
                root,
                f"diagnosis/{node}/rank-{rank}.stack.txt",
                f'Thread 0x1 (most recent call first):\n  File "train.py", line {80 + rank}\n',
            )
        beats = {
            "node": node,
            "attempt": "41.0",
            "time": NOW,
            "beats": {
                str(r): {"step": 7 if r != 3 else 6, "phase": "step", "pid": 100 + r, "time": NOW} for r in ranks
            },
            "step_times": {str(r): [0.2, 0.25] for r in ranks},
        }
        _write(root, f"diagnosis/{node}/heartbeats.json", heartbeats if heartbeats is not None else beats)
        _write(root, f"diagnosis/{node}/gpus.json", {"gpus": []})
        _write(root, f"diagnosis/{node}/nccl-trace-rank-{ranks[0]}", b"\x80\x04\x95binary pickle\x00\xff")
    _write(root, "diagnosis/n1/rank-10.stack.txt", "ten\n")
    return root


def test_logs_diagnosis_prints_the_verdict_stacks_and_heartbeats_and_lists_the_rest(tmp_path: Path) -> None:
    run_dir = _diagnosis(tmp_path / "a 'b' $c")
    files = fetch_diagnosis(LocalTransport(), str(run_dir))
    text = format_diagnosis(files, "41", str(run_dir))
    lines = text.splitlines()
    assert lines[:2] == ["== verdict", VERDICT["verdict"]]
    n1, n2 = lines.index("== node n1"), lines.index("== node n2")
    headers = [line for line in lines if line.startswith("-- rank ")]
    assert headers == [
        "-- rank 0 stack (rank-0.stack.txt)",
        "-- rank 1 stack (rank-1.stack.txt)",
        "-- rank 10 stack (rank-10.stack.txt)",  # by rank number, not by name
        "-- rank 2 stack (rank-2.stack.txt)",
        "-- rank 3 stack (rank-3.stack.txt)",
    ]
    assert (
        lines.index("-- rank 3 stack (rank-3.stack.txt)") > n2 > lines.index("-- rank 1 stack (rank-1.stack.txt)") > n1
    )
    assert '  File "train.py", line 83' in lines
    assert (
        f"rank 3: step 6, phase step, pid 103, last beat {time.strftime('%H:%M:%S', time.localtime(NOW))}, last step 0.25 s"
        in lines
    )
    assert "-- also here: gpus.json (12 bytes), nccl-trace-rank-2 (18 bytes)" in lines
    assert "binary pickle" not in text and "also: verdict.json" in text


def test_logs_diagnosis_survives_garbled_heartbeats_and_says_when_there_is_none(tmp_path: Path) -> None:
    run_dir = _diagnosis(tmp_path / "r", heartbeats='{"rank": 0, "st')
    text = format_diagnosis(fetch_diagnosis(LocalTransport(), str(run_dir)), "41", str(run_dir))
    assert '{"rank": 0, "st' in text
    assert heartbeat_lines('{"beats": {"10": {"step": 3}, "2": {}}, "step_times": 5}') == [
        "rank 2",
        "rank 10: step 3",
    ]
    assert heartbeat_lines("[1, 2]") == ["[1, 2]"]
    assert heartbeat_lines('{"beats": {"0": 5}}') == ['{"beats": {"0": 5}}']
    empty = tmp_path / "empty"
    empty.mkdir()
    assert fetch_diagnosis(LocalTransport(), str(empty)) == []
    assert format_diagnosis([], "41", str(empty)) == f"no hang was diagnosed for 41 (nothing in {empty}/diagnosis)\n"


def test_ckpt_is_the_newest_checkpoint_on_shared_storage_however_far_back_its_metrics_event_is(
    tmp_path: Path,
) -> None:
    """CKPT showed '-' once more step lines than the metrics tail holds followed the last
    checkpoint event (a long interval, a requeue's new steps), and for command jobs saving through meshrun.launcher.job."""
    from meshrun.launcher.contract.records.rundir import note_checkpoint

    run_dir = tmp_path / "run"
    note_checkpoint(str(run_dir), 40, {"MESHRUN_JOB_ID": "local-a"})
    marker = new_marker()
    (remote,) = findings.split_findings(
        LocalTransport().run(findings.findings_argv([str(run_dir)], False, marker)).stdout, 1, marker
    )
    assert remote == findings.read_files(str(run_dir), with_env=False)  # the same file, over SSH and here
    mine = findings.findings_from(remote, NOW, "local-a")
    assert mine.checkpoint_step == 40 and mine.progress({"step": 70}) == {"step": 70, "checkpoint_step": 40}
    theirs = findings.findings_from(remote, NOW, "local-b")  # the parent of a resume: its own events say
    assert (
        theirs.checkpoint_step is None and theirs.progress({"step": 19, "checkpoint_step": 15})["checkpoint_step"] == 15
    )
    assert findings.parse_last_checkpoint('{"step": true}', None) is None
    assert findings.parse_last_checkpoint("garbled", None) is None


def _metrics_line(run_dir: Path, row: dict[str, Any]) -> None:
    with open(run_dir / "metrics.jsonl", "a", encoding="utf-8") as handle:
        handle.write(json.dumps(row) + "\n")


def test_an_ended_job_keeps_its_step_and_checkpoint_after_a_resume_fills_the_metrics_tail(tmp_path: Path) -> None:
    """Journey seed 7015: an ended job showed CKPT 45, then 30, once a resume of it in the same run dir had
    run. Its status read the metrics tail, which the resume's lines fill, and RunDir.last_checkpoint, which the
    resume's copies rewrite; a copier's backlog committing an older step last made the newest line say 30.
    What an ended job shows comes from its own record, written at its end, and never goes back."""
    from meshrun.launcher.contract.records import goodput
    from meshrun.launcher.contract.records.rundir import local_state_path, merge_state, note_checkpoint

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    parent, child = {"MESHRUN_JOB_ID": "local-b"}, {"MESHRUN_JOB_ID": "local-d"}
    goodput.record_start(str(run_dir), "local-b", 0, NOW - 100, "n1")
    for step in range(31, 56):
        _metrics_line(run_dir, {"step": step, "loss": 1.0, "time": NOW - 100 + step, "job": "local-b"})
        if step == 45:
            note_checkpoint(str(run_dir), 45, parent)
            _metrics_line(run_dir, {"event": "checkpoint", "checkpoint_step": 45, "copied": True, "job": "local-b"})
    # The copier's backlog: step 30 committed after 45 (its copy had been killed and was started again).
    note_checkpoint(str(run_dir), 30, parent)
    _metrics_line(run_dir, {"event": "checkpoint", "checkpoint_step": 30, "copied": True, "job": "local-b"})
    goodput.record_end(str(run_dir), "local-b", 0, 1)
    goodput.write(str(run_dir), "local-b")
    merge_state(local_state_path(str(run_dir), "local-b"), state="FAILED", started=NOW - 100, ended=NOW - 40)
    record = JobRecord("local-b", "local", "n", str(run_dir), "local", NOW - 100, None, "h", "FAILED")

    def shown() -> tuple[Any, Any]:
        (found,) = LOCAL.statuses([record], LocalTransport())
        progress = found.progress
        return progress.get("step"), progress.get("checkpoint_step")

    assert shown() == (55, 45)
    # The resume: its own steps and checkpoints, more than the metrics tail holds.
    for step in range(46, 400):
        _metrics_line(run_dir, {"step": step, "loss": 0.5, "time": NOW + step, "job": "local-d", "pad": "x" * 40})
        if step % 15 == 0:
            note_checkpoint(str(run_dir), step, child)
            _metrics_line(run_dir, {"event": "checkpoint", "checkpoint_step": step, "copied": True, "job": "local-d"})
    assert shown() == (55, 45)
