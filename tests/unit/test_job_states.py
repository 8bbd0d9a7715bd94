"""meshrun's own job state type (submit/core/state.py) and the backends' tables onto it: every Slurm state name
squeue and sacct print, every word of a local job's state file; a name no table knows is UNKNOWN, never final;
and the type prints, serializes and is stored as the very word people read before it existed."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from meshrun.submit.core.state import FAILURE, FINAL, SUCCESS, JobState
from meshrun.submit.schedulers import local, slurm_cli

# What the Slurm module called final before the state type existed (its SUCCESS | FAILURE sets).
ENDED_BEFORE = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "PREEMPTED",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "REVOKED",
}
# Slurm's base states and the flags squeue/sacct print instead (slurm.schedmd.com/job_state_codes.html).
SLURM_NAMES = {
    *ENDED_BEFORE,
    "PENDING",
    "RUNNING",
    "SUSPENDED",
    "COMPLETING",
    "CONFIGURING",
    "EXPEDITING",
    "LAUNCH_FAILED",
    "POWER_UP_NODE",
    "RECONFIG_FAIL",
    "REQUEUED",
    "REQUEUE_FED",
    "REQUEUE_HOLD",
    "RESIZING",
    "RESV_DEL_HOLD",
    "REVOKED",
    "SIGNALING",
    "SPECIAL_EXIT",
    "STAGE_OUT",
    "STOPPED",
    "UPDATE_DB",
}


def test_the_slurm_table_names_every_state_slurm_prints() -> None:
    assert set(slurm_cli.STATES) == SLURM_NAMES


@pytest.mark.parametrize("name", sorted(SLURM_NAMES))
def test_each_slurm_name_reads_as_the_same_word_and_ends_as_before(name: str) -> None:
    state = slurm_cli.state_of(name)
    assert isinstance(state, JobState) and state.value == name  # what `meshrun status` prints: unchanged
    assert (state in FINAL) == (name in ENDED_BEFORE)
    assert (state in SUCCESS) == (name == "COMPLETED")
    assert slurm_cli.unknown_state_note(name) is None


@pytest.mark.parametrize(
    "text, state",
    [
        ("CANCELLED by 123", JobState.CANCELLED),  # sacct names who cancelled
        ("CANCELLED+", JobState.CANCELLED),  # some squeue versions mark it
        ("completed", JobState.COMPLETED),
        (" RUNNING ", JobState.RUNNING),
    ],
)
def test_slurm_decorations_are_read_through(text: str, state: JobState) -> None:
    assert slurm_cli.state_of(text) is state


@pytest.mark.parametrize("text", ["", "   ", "WIBBLE", "UNKNOWN"])
def test_a_state_no_table_knows_is_unknown_and_never_final(text: str) -> None:
    """As before: such a job is still followed (not done, not succeeded), and its word is not lost."""
    state = slurm_cli.state_of(text)
    assert state is JobState.UNKNOWN and state not in FINAL
    note = slurm_cli.unknown_state_note(text)
    assert note == (f"Slurm state {text.strip()}" if text.strip() else None)


def test_an_unknown_word_in_sacct_and_squeue_keeps_the_job_followed_and_says_the_word() -> None:
    acct = slurm_cli.parse_sacct("21|n|WIBBLE|0:0|00:00:01|00:10:00|n1\n")["21"]
    assert acct.state is JobState.UNKNOWN and not acct.done and acct.reason == "Slurm state WIBBLE"
    live = slurm_cli.parse_squeue("21|WIBBLE|0:01|10:00|n1|None\n")["21"]
    assert live.state is JobState.UNKNOWN and not live.done and live.reason == "Slurm state WIBBLE"
    assert slurm_cli.parse_squeue("22|PENDING|0:00|10:00||Priority\n")["22"].reason == "Priority"


def test_the_local_table_reads_every_word_a_local_state_file_holds() -> None:
    for word in ("PENDING", "RUNNING", "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "PREEMPTED"):
        assert local.STATES[word].value == word
    assert set(local.ACTIVE) <= set(local.STATES) and not FINAL & {local.STATES[w] for w in local.ACTIVE}


def test_the_sets_are_defined_once_and_agree() -> None:
    assert FINAL == SUCCESS | FAILURE and not SUCCESS & FAILURE
    assert {s.value for s in FINAL} == ENDED_BEFORE
    assert {JobState.SUBMITTED, JobState.UNKNOWN, JobState.UNREACHABLE}.isdisjoint(FINAL)


def test_a_state_prints_serializes_and_is_stored_as_its_word() -> None:
    state = JobState.NODE_FAIL
    assert str(state) == f"{state}" == f"{state:<10}".rstrip() == "NODE_FAIL"
    assert json.dumps({"state": state}) == '{"state": "NODE_FAIL"}'
    assert state == "NODE_FAIL" and "NODE_FAIL" in FINAL and JobState("NODE_FAIL") is state
    assert ", ".join(sorted({JobState.TIMEOUT, JobState.CANCELLED})) == "CANCELLED, TIMEOUT"
    db = sqlite3.connect(":memory:")
    db.execute("CREATE TABLE t (s TEXT)")
    db.execute("INSERT INTO t VALUES (?)", (state.value,))
    assert db.execute("SELECT s FROM t").fetchone() == ("NODE_FAIL",)


@pytest.mark.parametrize("word", ["RUNNING", "NODE_FAIL", "UNREACHABLE"])
def test_the_views_show_a_state_exactly_as_they_showed_its_word(word: str) -> None:
    from meshrun.submit.core.status import Status
    from meshrun.submit.views import top
    from meshrun.submit.views.tables import detail_lines, progress_line, status_table

    fields: dict = dict(elapsed_s=5, progress={"step": 3, "loss": 1.0}, reason="r")
    typed = Status("1", "c", "n", JobState(word), "/r", 0.0, False, False, **fields)
    plain = Status("1", "c", "n", word, "/r", 0.0, False, False, **fields)  # type: ignore[arg-type]
    assert status_table([typed]) == status_table([plain]) and detail_lines(typed) == detail_lines(plain)
    assert progress_line(typed, 10) == progress_line(plain, 10) and top.row(typed) == top.row(plain)
    assert json.dumps(typed.as_json()) == json.dumps(plain.as_json())


@pytest.mark.parametrize(
    "kind, state, problem",
    [
        ("ok", JobState.RUNNING, None),
        ("ok", JobState.COMPLETED, None),
        ("ok", JobState.FAILED, "ended FAILED: afterok would never release"),
        ("ok", JobState.CANCELLED, "ended CANCELLED: afterok would never release"),
        ("any", JobState.FAILED, None),
        ("notok", JobState.FAILED, None),
        ("notok", JobState.COMPLETED, "afternotok would never release"),
        ("start", JobState.UNKNOWN, "Slurm knows no job 42"),
        ("ok", JobState.UNKNOWN, "Slurm knows no job 42"),
    ],
)
def test_a_dependency_that_cannot_do_what_was_meant_is_named(kind: str, state: JobState, problem: str | None) -> None:
    from meshrun.submit.schedulers.slurm_cli import SlurmJob, dependency_problem, dependency_target

    assert dependency_target(f"{kind}:42") == (kind, "42") and dependency_target("42") == ("ok", "42")
    said = dependency_problem(kind, SlurmJob(job_id="42", state=state))
    assert (said is None) if problem is None else (said is not None and problem in said), said


def test_each_job_in_a_run_dir_reads_its_own_progress_checkpoint_and_alerts() -> None:
    """A resume appends to its parent's metrics.jsonl and alerts.jsonl under its own id: the parent keeps
    the step and checkpoint it ended with, the child does not show the parent's alert."""
    from meshrun.submit.core.findings import ALERTS, findings_from
    from meshrun.submit.core.status import parse_losses, parse_metrics_tail

    lines = [
        {"step": 19, "loss": 2.0, "job": "local-a"},
        {"event": "checkpoint", "checkpoint_step": 19, "job": "local-a"},
        {"step": 20, "loss": 1.5, "job": "local-b"},
        {"step": 40, "loss": 1.0, "job": "local-b"},
        {"event": "checkpoint", "checkpoint_step": 40, "job": "local-b"},
    ]
    text = "".join(json.dumps(line) + "\n" for line in lines)
    parent, child = parse_metrics_tail(text, "local-a"), parse_metrics_tail(text, "local-b")
    assert (parent["step"], parent["checkpoint_step"]) == (19, 19)
    assert (child["step"], child["checkpoint_step"]) == (40, 40)
    assert parse_metrics_tail(text)["step"] == 40 and parse_losses(text, "local-a") == [2.0]
    old = json.dumps({"step": 7, "loss": 3.0}) + "\n"  # a line written before lines named their job
    assert parse_metrics_tail(old, "local-a")["step"] == 7
    alerts = [
        {"rule": "nonfinite_loss", "step": 12, "time": 1000.0, "job": "local-a", "message": "m"},
        {"rule": "loss_spike", "step": 30, "time": 1100.0, "job": "local-b", "message": "m"},
    ]
    files = {ALERTS: "".join(json.dumps(a) + "\n" for a in alerts)}
    assert [a["rule"] for a in findings_from(files, 1050.0, "local-b").alerts] == ["loss_spike"]
    assert [a["rule"] for a in findings_from(files, 900.0, "local-a").alerts] == ["nonfinite_loss"]


def test_records_name_the_job_that_wrote_them() -> None:
    from meshrun.launcher.contract.records import alerts
    from meshrun.launcher.contract.records.rundir import job_field, job_of

    assert job_of({"SLURM_JOB_ID": "125", "SLURM_ARRAY_JOB_ID": "123", "SLURM_ARRAY_TASK_ID": "4"}) == "123_4"
    assert job_of({"SLURM_JOB_ID": "125"}) == "125" and job_of({"MESHRUN_JOB_ID": "local-ab"}) == "local-ab"
    assert job_of({}) is None and job_field({}) == {} and job_field({"SLURM_JOB_ID": "9"}) == {"job": "9"}
    alert = alerts.Alert("loss_spike", 3.0, 2.0, "m", job="77")
    assert alert.record()["job"] == "77"


def _failed(job_id: str, cluster: str = "local", **fields: Any) -> Any:
    """A FAILED job's Status as status builds it at its end (run dir /r, submitted at 1.0)."""
    from meshrun.submit.core.status import Status

    return Status(
        job_id=job_id,
        cluster=cluster,
        name="j",
        state=JobState.FAILED,
        run_dir="/r",
        submitted_at=1.0,
        done=True,
        succeeded=False,
        **fields,
    )


def test_a_final_job_keeps_the_progress_and_reason_it_ended_with(tmp_path: Path) -> None:
    """Once its lines have left the metrics tail (a resume wrote on), the row shows what status saw at the end
    wherever today's reading has less: a new user's trial saw an ended job's LOSS go '-' and its reason vanish
    (the resume's start removes the run dir's rank error). A running job never takes it; what is read wins."""
    import dataclasses

    from meshrun.submit.core.registry import JobRecord, Registry
    from meshrun.submit.core.status import kept_at_end

    registry = Registry(tmp_path / "r.sqlite")
    record = JobRecord("local-a", "local", "j", "/r", "local", 1.0, None, "h")
    registry.add(record)
    said = "stopped by preemption (no step reported): requeue limit (checkpoint.max_requeues=0) reached"
    registry.set_state(record, "FAILED", json.dumps({"step": 19, "checkpoint_step": 19, "loss": 2.5961}), said)
    (stored,) = registry.recent(5)
    assert stored.last_progress is not None and stored.last_reason == said
    ended = _failed("local-a")
    assert kept_at_end(stored, ended).progress == {"step": 19, "checkpoint_step": 19, "loss": 2.5961}
    assert kept_at_end(stored, ended).reason == said
    # Its goodput record still gives the step and checkpoint: the loss comes from what was kept.
    recorded = kept_at_end(stored, dataclasses.replace(ended, progress={"step": 19, "checkpoint_step": 19}))
    assert recorded.progress == {"step": 19, "checkpoint_step": 19, "loss": 2.5961}
    assert kept_at_end(stored, dataclasses.replace(ended, reason="read today")).reason == "read today"
    running = dataclasses.replace(ended, state=JobState.RUNNING, done=False)
    assert kept_at_end(stored, running).progress == {} and kept_at_end(stored, running).reason is None
    registry.set_state(stored, "FAILED")  # a later state change without progress keeps both
    assert registry.recent(5)[0].last_progress == stored.last_progress and registry.recent(5)[0].last_reason == said


def test_a_dependency_on_a_job_array_stands_for_all_its_tasks() -> None:
    from meshrun.submit.schedulers.slurm_cli import SlurmJob, dependency_state

    def rows(*states: JobState) -> dict[str, SlurmJob]:
        return {f"7_{n}": SlurmJob(job_id=f"7_{n}", state=state) for n, state in enumerate(states)}

    assert dependency_state("7", rows(JobState.COMPLETED, JobState.CANCELLED), {}).state is JobState.CANCELLED
    assert dependency_state("7", rows(JobState.COMPLETED, JobState.COMPLETED), {}).state is JobState.COMPLETED
    going = {"7_1": SlurmJob(job_id="7_1", state=JobState.RUNNING)}  # squeue knows a task sacct has not yet
    assert dependency_state("7", rows(JobState.COMPLETED), going).state is JobState.RUNNING
    assert dependency_state("70", rows(JobState.COMPLETED), {}).state is JobState.UNKNOWN  # 7_0 is not 70's
    assert dependency_state("8", {"8": SlurmJob(job_id="8", state=JobState.FAILED)}, {}).state is JobState.FAILED
    # Just cancelled: squeue still lists the tasks COMPLETING (status keeps them not done) but the outcome is
    # decided, and afterok on it would never release (the docs' sweep example caught it).
    ending = {f"7_{n}": SlurmJob(job_id=f"7_{n}", state=JobState.COMPLETING) for n in range(2)}
    assert dependency_state("7", rows(JobState.CANCELLED, JobState.CANCELLED), ending).state is JobState.CANCELLED


def test_a_resumed_job_starts_with_nothing_status_saw_of_its_parent(tmp_path: Path) -> None:
    """A new user's trial: the resume of a cancelled job ran to COMPLETED, and status still gave it the cancelled
    job's reason ("checkpoint saved: `meshrun resume` continues it"), copied with the rest of the parent's row."""
    from meshrun.submit.core.registry import JobRecord, Registry

    registry = Registry(tmp_path / "r.sqlite")
    parent = JobRecord("local-a", "local", "j", "/r", "local", 1.0, None, "h")
    registry.add(parent)
    registry.set_state(parent, "CANCELLED", json.dumps({"step": 207}), "checkpoint saved: resume", (2, 1))
    (seen,) = registry.recent(5)
    child = seen.resubmitted("local-b", 2.0)
    assert (child.job_id, child.submitted_at, child.last_state) == ("local-b", 2.0, "SUBMITTED")
    assert (child.last_progress, child.last_reason, child.last_restarts, child.last_restarts_in_job) == (None,) * 4
    assert (child.last_elapsed_s, child.last_seen_at, child.chosen) == (None, None, None)
    assert (child.run_dir, child.name, child.cluster, child.spec_hash) == (parent.run_dir, "j", "local", "h")


def test_an_ended_job_keeps_its_restarts_and_a_reason_read_after_its_end(tmp_path: Path) -> None:
    """A new user's trial: with the cluster unreachable, ended jobs showed RESTARTS 0 where they had shown 1, and
    a reason read only after the end was first seen (the batch log's last line came later) was never kept."""
    import dataclasses

    from meshrun.submit.core import status as status_mod
    from meshrun.submit.core.registry import JobRecord, Registry

    registry = Registry(tmp_path / "r.sqlite")
    record = JobRecord("7", "c", "j", "/r", "slurm", 1.0, None, "h")
    registry.add(record)
    ended = _failed("7", cluster="c", restarts=1, restarts_in_job=2)
    assert status_mod._news_for_the_registry(record, ended)
    registry.set_state(record, "FAILED", None, None, (1, 2))
    (stored,) = registry.recent(5)
    assert not status_mod._news_for_the_registry(stored, ended)
    late = dataclasses.replace(ended, reason="gave up (crash loop)")
    assert status_mod._news_for_the_registry(stored, late)
    registry.set_state(stored, "FAILED", None, late.reason, (1, 2))
    (stored,) = registry.recent(5)
    kept = status_mod._kept_or_unreachable(stored, "connection refused")
    assert (kept.state, kept.restarts, kept.restarts_in_job) == (JobState.FAILED, 1, 2)
    assert status_mod.kept_at_end(stored, kept).reason == "gave up (crash loop)"
    running = dataclasses.replace(ended, state=JobState.RUNNING, done=False, reason="x")
    assert status_mod._news_for_the_registry(stored, running)  # a state change is always news
    assert not status_mod._news_for_the_registry(stored, dataclasses.replace(kept, state=JobState.UNREACHABLE))
