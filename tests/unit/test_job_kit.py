"""meshrun.launcher.job (the kit for a command job's own script) and meshrun.launcher.batch.requeue (the requeue decision)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from meshrun.launcher.batch.requeue import crash_loop, decide, main
from meshrun.launcher.contract.exitcodes import EXIT_DIVERGED, EXIT_GAVE_UP, EXIT_INPUT, EXIT_NO_PROGRESS, EXIT_REQUEUE
from meshrun.launcher.contract.records import ckptdir
from meshrun.launcher.contract.records.rundir import RunDir
from meshrun.launcher.report import ProgressMark, reported_step

REPO = Path(__file__).resolve().parents[2]


def _script(code: str, env: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**os.environ, "PYTHONPATH": str(REPO), **env},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_stop_signal_before_the_first_should_stop_is_kept_not_fatal(tmp_path: Path) -> None:
    # Under meshrun the handler is in place from the import: a USR1 that arrives before the script ever
    # asks neither kills it (USR1's default action) nor is lost.
    code = """
        import os, signal, sys
        from meshrun.launcher import job
        os.kill(os.getpid(), signal.SIGUSR1)
        print("stop" if job.should_stop() else "go", "torch" in sys.modules)
    """
    out = _script(code, {"MESHRUN_STOP_SIGNALS": "SIGUSR1,SIGTERM"}, tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["stop", "False"]  # and it never imported torch


def test_should_stop_outside_meshrun_listens_from_its_first_call(tmp_path: Path) -> None:
    code = """
        import os, signal
        from meshrun.launcher import job
        first = job.should_stop()
        os.kill(os.getpid(), signal.SIGTERM)
        print(first, job.should_stop())
    """
    env = {k: v for k, v in os.environ.items() if k != "MESHRUN_STOP_SIGNALS"}
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**env, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True"]


def test_exit_for_requeue_exits_75_and_rank_0_records_it(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    code = "from meshrun.launcher import job\njob.exit_for_requeue()\nprint('not reached')"
    out = _script(code, {"MESHRUN_RUN_DIR": str(run_dir), "RANK": "0"}, tmp_path)
    assert out.returncode == EXIT_REQUEUE and "not reached" not in out.stdout
    assert (run_dir / RunDir.EXIT_CODE).read_text() == f"{EXIT_REQUEUE}\n"
    out = _script(code, {"MESHRUN_RUN_DIR": str(tmp_path / "other"), "RANK": "1"}, tmp_path)
    assert out.returncode == EXIT_REQUEUE and not (tmp_path / "other").exists()  # only rank 0 writes


def test_latest_checkpoint_is_the_newest_complete_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from meshrun.launcher import job

    root = tmp_path / "ckpts"
    monkeypatch.setenv(job.CHECKPOINT_DIR_ENV, str(root))
    assert job.latest_checkpoint() is None
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    first = job.new_checkpoint(10)
    (first / "state.pt").write_text("ten")
    done = job.mark_complete(first, note="x")
    assert done == ckptdir.step_dir(root, 10) and not first.exists()
    assert ckptdir.read_marker(done)["step"] == 10 and ckptdir.read_marker(done)["note"] == "x"
    assert stat.S_IMODE((done / "state.pt").stat().st_mode) == 0o600
    # An interrupted save (never marked) and a folder written under its final name but not marked: ignored.
    (job.new_checkpoint(20) / "state.pt").write_text("half")
    (root / "step-30").mkdir()
    (root / "step-30" / "state.pt").write_text("thirty")
    assert job.latest_checkpoint() == done
    # A user's own `step-30` folder becomes a checkpoint once marked (under the canonical name).
    assert job.mark_complete(root / "step-30") == ckptdir.step_dir(root, 30) == job.latest_checkpoint()
    assert (job.latest_checkpoint() / "state.pt").read_text() == "thirty"
    with pytest.raises(ValueError, match="name it step-N"):
        job.mark_complete(root / "final")
    with pytest.raises(ValueError, match="put it in job.checkpoint_dir"):
        (tmp_path / "step-40").mkdir()
        job.mark_complete(tmp_path / "step-40")


def test_the_progress_mark_only_rises_and_is_written_on_close(tmp_path: Path) -> None:
    run = str(tmp_path)
    mark = ProgressMark(run)
    mark.note(5)  # the first one is written at once
    assert reported_step(run) == 5
    mark.note(9)  # within the second: kept in memory
    assert reported_step(run) == 5
    mark.flush()
    assert reported_step(run) == 9
    again = ProgressMark(run)  # a resumed run repeating steps it already did
    again.note(7)
    again.flush()
    assert reported_step(run) == 9


def _command_run(tmp_path: Path, reported: int | None = None) -> str:
    run = str(tmp_path)
    if reported is not None:
        mark = ProgressMark(run)
        mark.note(reported)
        mark.flush()
    return run


DECISIONS = [
    # status, restarts, stop requested, terminated -> requeue?, code, words in the line
    (0, 0, False, False, False, 0, "finished"),
    (EXIT_INPUT, 0, False, False, False, EXIT_INPUT, "bad input"),
    (EXIT_GAVE_UP, 0, False, False, False, EXIT_GAVE_UP, "gave up (crash loop)"),
    (EXIT_DIVERGED, 0, False, False, False, EXIT_DIVERGED, "diverged"),
    (EXIT_REQUEUE, 0, False, False, True, EXIT_REQUEUE, "requeueing: restart 1 of at most 20"),
    (EXIT_NO_PROGRESS, 3, False, False, True, EXIT_NO_PROGRESS, "requeueing: restart 4 of at most 20"),
    (1, 0, False, False, True, 1, "requeueing: restart 1"),
    (143, 0, False, True, False, 143, "SIGTERM"),
    (EXIT_REQUEUE, 20, False, False, False, EXIT_REQUEUE, "requeue limit (checkpoint.max_requeues=20) reached"),
]


@pytest.mark.parametrize("status,restarts,stop,term,requeue,code,words", DECISIONS)
def test_the_decision_table(
    tmp_path: Path, status: int, restarts: int, stop: bool, term: bool, requeue: bool, code: int, words: str
) -> None:
    for command_job in (False, True):  # a single run: the crash-loop rule never fires on the first failure
        d = decide(str(tmp_path / str(command_job)), status, restarts, 20, stop, term, command_job)
        assert (d.requeue, d.code) == (requeue, code) and words in d.why, d


def test_a_command_job_that_fails_twice_without_progress_gives_up(tmp_path: Path) -> None:
    run = _command_run(tmp_path)
    first = decide(run, 1, 0, 20, command_job=True)
    assert first.requeue
    second = decide(run, 1, 1, 20, command_job=True)
    assert (second.requeue, second.code) == (False, EXIT_GAVE_UP)
    assert "crash loop: 2 runs in a row failed without reporting a step at all" in second.why
    assert second.line().startswith(f"stop {EXIT_GAVE_UP} gave up (crash loop: ")
    assert (Path(run) / RunDir.RANK_ERROR).read_text().startswith("gave up (crash loop")  # status's reason


def test_progress_clears_the_count_and_repeating_old_steps_is_not_progress(tmp_path: Path) -> None:
    run = _command_run(tmp_path, reported=100)
    assert decide(run, 1, 0, 20, command_job=True).requeue  # got to 100, then failed: progress
    assert decide(run, 1, 1, 20, command_job=True).requeue  # nothing new: 1 in a row
    _command_run(tmp_path, reported=150)
    assert decide(run, 1, 2, 20, command_job=True).requeue  # 150 > 100: cleared
    assert decide(run, 1, 3, 20, command_job=True).requeue  # 1 in a row
    d = decide(run, 1, 4, 20, command_job=True)  # resumed at 120, crashed at 150 again: 2 in a row
    assert d.code == EXIT_GAVE_UP and "beyond step 150" in d.why


def test_clean_stops_never_count_and_the_built_in_trainer_keeps_its_own_guard(tmp_path: Path) -> None:
    run = _command_run(tmp_path)
    for restarts in range(4):  # preempted again and again before reporting anything
        assert decide(run, EXIT_REQUEUE, restarts, 20, command_job=True).requeue
        assert decide(run, 137, restarts, 20, stop_requested=True, command_job=True).requeue  # died of USR1
    trainer = str(tmp_path / "trainer")
    assert all(decide(trainer, 1, r, 20, command_job=False).requeue for r in range(4))
    assert crash_loop(run, failed=True) is None  # counts start from the clean stops' zero


def test_the_batch_scripts_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "spec.json").write_text(
        json.dumps(
            {
                "job": {"name": "x", "resources": {"nodes": 1, "tasks_per_node": 1}, "command": ["false"]},
                "run": {"cluster": "testbed", "scheduler": "slurm", "run_dir": str(tmp_path)},
            }
        )
    )
    assert main([str(tmp_path), "1", "0", "20"]) == 0
    assert capsys.readouterr().out == "requeue 1 requeueing: restart 1 of at most 20\n"
    assert main([str(tmp_path), "1", "1", "20"]) == 0
    assert capsys.readouterr().out.startswith(f"stop {EXIT_GAVE_UP} gave up (crash loop: 2 runs in a row")
    assert main([str(tmp_path), "x", "1", "20"]) == 2
    assert "usage:" in capsys.readouterr().err


def test_a_programs_own_exit_2_is_a_failure_and_only_a_reported_bad_input_is_meshruns_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A command's argparse error (exit 2) ended the job as meshrun's 'bad input'."""
    (tmp_path / "spec.json").write_text(
        json.dumps(
            {
                "job": {"name": "x", "resources": {"nodes": 1, "tasks_per_node": 1}, "command": ["false"]},
                "run": {"cluster": "testbed", "scheduler": "slurm", "run_dir": str(tmp_path)},
            }
        )
    )
    assert main([str(tmp_path), "2", "0", "20"]) == 0
    said = capsys.readouterr().out
    assert said.startswith("requeue 1 the program exited with code 2, its own (no bad input was reported): "), said
    (tmp_path / RunDir.RANK_ERROR).write_text(
        "rank 0: data.path: '/x': no token file there\n"
    )  # meshrun.launcher.job's
    assert main([str(tmp_path), "2", "1", "20"]) == 0
    assert capsys.readouterr().out == "stop 2 bad input (exit 2): not requeueing\n"


# Job 30's batch log on the testbed (slurm-wlm 22.05): rank 0 killed with -9 by a journey, srun's
# --kill-on-bad-exit then ended rank 1; requeued, the second run was cancelled.
BATCH_LOG = """\
[meshrun] job 30 restart 0 on n[1-2] at 2026-12-03T08:07:01Z
srun: error: n1: task 0: Killed
srun: launch/slurm: _step_signal: Terminating StepId=30.1
srun: error: n2: task 1: Terminated
srun: Force Terminated StepId=30.1
[meshrun] ranks exited with status 143 at 2026-12-03T08:07:23Z
[meshrun] requeueing: restart 1 of at most 20
[meshrun] job 30 restart 1 on n[1-2] at 2026-12-03T08:07:34Z
srun: error: n2: task 1: Exited with exit code 3
srun: error: n1: task 0: Terminated
"""


def test_on_slurm_the_first_rank_a_signal_ended_leads_the_reason(tmp_path: Path) -> None:
    """On Slurm: the reason named what the surviving rank said, not the rank killed first."""
    from meshrun.launcher.batch.requeue import record_first_death

    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "slurm-30.out").write_text(BATCH_LOG)
    error = tmp_path / RunDir.RANK_ERROR
    error.write_text("rank 1: RuntimeError: Connection closed by peer\n")
    record_first_death(str(tmp_path), 0, {"SLURM_JOB_ID": "30"})
    said = error.read_text()
    assert said.startswith("rank 0 (on n1) was killed by SIGKILL (kill -9, or the kernel's out-of-memory killer")
    assert said.endswith(", first; then rank 1: RuntimeError: Connection closed by peer\n")
    error.unlink()
    record_first_death(str(tmp_path), 1, {"SLURM_JOB_ID": "30"})  # restart 1: rank 1 exited with a code of its own
    assert not error.exists()
    record_first_death(str(tmp_path), 0, {})  # not under Slurm: nothing to read
    assert not error.exists()


def _command_spec(run_dir: Path, **job: object) -> None:
    (run_dir / "spec.json").write_text(
        json.dumps(
            {
                "job": {"name": "x", "resources": {"nodes": 1, "tasks_per_node": 1}, "command": ["true"], **job},
                "run": {"cluster": "testbed", "scheduler": "slurm", "run_dir": str(run_dir)},
            }
        )
    )


def test_an_exit_0_after_a_stop_is_a_stop_unless_the_program_said_it_finished(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lightning leaves its loop on the preemption's SIGTERM and exits 0; the job ended COMPLETED
    with 2 of 2,000 epochs done. Now it is requeued as a stop, and status says where it stopped."""
    from meshrun.launcher import job
    from meshrun.launcher.contract.records import finish
    from meshrun.submit.core.status import parse_metrics_tail

    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    monkeypatch.setenv("MESHRUN_RUN_DIR", str(tmp_path))
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("SLURM_PROCID", raising=False)
    _command_spec(tmp_path)
    assert main([str(tmp_path), "0", "0", "20", "--stop-requested=preemption"]) == 0
    said = capsys.readouterr().out
    assert said.startswith(f"requeue {EXIT_REQUEUE} stopped by preemption (no step reported): the program exited 0"), (
        said
    )
    assert said.rstrip().endswith("requeueing: restart 1 of at most 20"), said
    assert parse_metrics_tail((tmp_path / "metrics.jsonl").read_text(), "4242")["stopped"] == (
        "stopped by preemption (no step reported)"
    )
    mark = ProgressMark(str(tmp_path))  # a program that reports its steps: status names the step
    mark.note(40)
    mark.flush()
    assert main([str(tmp_path), "0", "1", "20", "--stop-requested=time-limit"]) == 0
    assert "stopped at the time limit at step 40: " in capsys.readouterr().out
    # A step line after the stop: status shows progress again, not the old stop.
    with open(tmp_path / "metrics.jsonl", "a") as metrics:
        metrics.write(json.dumps({"step": 41, "loss": 1.0, "job": "4242"}) + "\n")
    assert "stopped" not in parse_metrics_tail((tmp_path / "metrics.jsonl").read_text(), "4242")
    # The restart limit: the job ends, never as a success, and its reason says it stopped.
    assert main([str(tmp_path), "0", "20", "20", "--stop-requested=preemption"]) == 0
    said = capsys.readouterr().out
    assert said.startswith(f"stop {EXIT_REQUEUE} stopped by preemption at step 40: "), said
    assert "requeue limit (checkpoint.max_requeues=20) reached" in (tmp_path / RunDir.RANK_ERROR).read_text()
    # finished() in an earlier start counts for nothing; in this one it makes the 0 a finish.
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    job.finished(40)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    assert not finish.declared(str(tmp_path))
    assert main([str(tmp_path), "0", "2", "20", "--stop-requested=preemption"]) == 0
    assert capsys.readouterr().out.startswith(f"requeue {EXIT_REQUEUE} stopped by preemption at step 40")
    job.finished(40)
    assert main([str(tmp_path), "0", "2", "20", "--stop-requested=preemption"]) == 0
    assert capsys.readouterr().out == "stop 0 finished (exit 0): not requeueing\n"
    # Without a stop passed on, an exit 0 is what it always was.
    monkeypatch.setenv("SLURM_RESTART_COUNT", "3")
    assert main([str(tmp_path), "0", "3", "20"]) == 0
    assert capsys.readouterr().out == "stop 0 finished (exit 0): not requeueing\n"
    assert main([str(tmp_path), "0", "3", "20", "--stop-requested=sometime"]) == 2  # an unknown stop: usage


def test_the_declared_last_step_and_the_built_in_trainer_make_an_exit_0_a_finish(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "4243")
    _command_spec(tmp_path, command_steps=50)
    mark = ProgressMark(str(tmp_path))
    mark.note(49)
    mark.flush()
    assert main([str(tmp_path), "0", "0", "20", "--stop-requested=preemption"]) == 0
    assert capsys.readouterr().out.startswith(f"requeue {EXIT_REQUEUE} stopped by preemption at step 49")
    mark.note(50)
    mark.flush()
    assert main([str(tmp_path), "0", "1", "20", "--stop-requested=preemption"]) == 0
    assert capsys.readouterr().out == "stop 0 finished (exit 0): not requeueing\n"
    trainer = tmp_path / "trainer"  # the built-in trainer's 0 is its agreed finish (train.steps trained)
    trainer.mkdir()
    (trainer / "spec.json").write_text(
        json.dumps(
            {
                "job": {"name": "x", "resources": {"nodes": 1, "tasks_per_node": 1}},
                "run": {"cluster": "testbed", "scheduler": "slurm", "run_dir": str(trainer)},
            }
        )
    )
    assert main([str(trainer), "0", "0", "20", "--stop-requested=preemption"]) == 0
    assert capsys.readouterr().out == "stop 0 finished (exit 0): not requeueing\n"


def test_command_steps_belongs_to_command_jobs() -> None:
    from meshrun.launcher.contract.spec.job import JobSpec
    from meshrun.launcher.contract.spec.schema import SchemaError, load

    with pytest.raises(SchemaError, match="command_steps.*train.steps"):
        JobSpec(name="x", command_steps=5)
    with pytest.raises(SchemaError, match="command_steps: 0: give the step your program reports last"):
        load(JobSpec, {"name": "x", "command": ["true"], "command_steps": 0})
    assert JobSpec(name="x", command=("true",), command_steps=5).command_steps == 5


# A profile's Pyxis flags on a cluster without Pyxis (a new user's trial): srun refuses its own command line; no rank
# ever starts. Status said FAILED with no reason, and the job was requeued 8 times, failing the same way.
REFUSED_LOG = """\
[meshrun] job 700 restart 0 on n[1-2] at 2026-12-07T10:00:00Z
srun: unrecognized option '--container-image=nvcr.io#nvidia/pytorch:24.01-py3'
Try "srun --help" for more information
[meshrun] ranks exited with status 1 at 2026-12-07T10:00:01Z
"""


def test_a_job_whose_ranks_never_started_says_why_and_is_not_requeued_to_fail_again(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from meshrun.launcher.batch import rankends

    monkeypatch.setenv("SLURM_JOB_ID", "700")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    monkeypatch.delenv("MESHRUN_RESTART_IN_JOB", raising=False)
    _command_spec(tmp_path)
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "slurm-700.out").write_text(REFUSED_LOG)
    assert main([str(tmp_path), "1", "0", "20"]) == 0
    assert capsys.readouterr().out == "stop 2 bad input (exit 2): not requeueing\n"
    reason = (tmp_path / RunDir.RANK_ERROR).read_text()
    assert (
        reason
        == "the ranks never started: srun: unrecognized option '--container-image=nvcr.io#nvidia/pytorch:24.01-py3'\n"
    )
    # srun's other complaints name the cause too, but may pass (a step that could not be created): requeued.
    line = "[meshrun] job 700 restart 0 on "
    other = f"{line}n1\nsrun: error: Unable to create step for job 700: Socket timed out\n"
    assert rankends.launch_failure(other, line) == "srun: error: Unable to create step for job 700: Socket timed out"
    assert not rankends.refused_argv(rankends.launch_failure(other, line) or "")
    # Once a task ended, the ranks ran: their own errors say why, not srun's chatter.
    ran = f"{line}n1\nsrun: error: n1: task 0: Exited with exit code 1\nsrun: error: Timed out waiting for step\n"
    assert rankends.launch_failure(ran, line) is None


@pytest.mark.parametrize("replace_process", [False, True])
def test_a_command_not_on_path_is_bad_input_named_in_the_rank_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, replace_process: bool
) -> None:
    """A new user's trial: a command that does not exist started twice and ended 'gave up (crash loop ...)'; the
    cause was only in `meshrun logs`. It is bad input now: exit 2 (never requeued), and the rank error names it."""
    from meshrun.launcher.batch.requeue import programs_own
    from meshrun.launcher.rank import entry

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    _command_spec(run_dir, command=["no-such-program-xyz", "--flag"])
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK"))})
    assert entry.run_rank(str(run_dir), replace_process=replace_process) == EXIT_INPUT
    said = (run_dir / RunDir.RANK_ERROR).read_text()
    assert said.startswith("rank 0: command: 'no-such-program-xyz': not found on PATH on "), said
    assert "give an absolute path, or install it on the cluster" in said, said
    assert (run_dir / RunDir.EXIT_CODE).read_text().strip() == str(EXIT_INPUT)
    assert programs_own(str(run_dir), EXIT_INPUT) == (EXIT_INPUT, "")  # meshrun's verdict, not the program's own 2
