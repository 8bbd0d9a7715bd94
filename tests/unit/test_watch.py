"""`meshrun watch`'s own pieces: the notify command's input and its one-line errors, and the lines a
person following jobs sees (the live loop against real jobs is tests/integration/test_alerts_live.py)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

from meshrun.submit.core.state import JobState
from meshrun.submit.core.status import Status
from meshrun.submit.errors import InputError
from meshrun.submit.views import watch


def _status(**kw: Any) -> Status:
    base: dict[str, Any] = dict(
        job_id="j1", cluster="local", name="n", state=JobState.RUNNING, run_dir="/r", submitted_at=0.0,
        done=False, succeeded=False,
    )  # fmt: skip
    return Status(**{**base, **kw})


def test_the_notify_input_is_one_json_line_ending_in_a_newline() -> None:
    data = watch.payload(_status(), {"rule": "loss_spike", "step": 3})
    assert data.endswith(b"\n") and data.count(b"\n") == 1
    assert json.loads(data) == {"rule": "loss_spike", "step": 3, "job_id": "j1", "cluster": "local", "name": "n"}


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda d: "no-such-program-xyz", "on PATH"),
        (lambda d: str(d / "missing" / "cmd"), "no such file; check the path"),
        (lambda d: str(d), "a folder, not a program"),
        (lambda d: str(d / "plain.sh"), "chmod u+x"),
    ],
    ids=["bare-name", "missing-path", "folder", "not-executable"],
)
def test_a_notify_command_that_cannot_run_says_why(tmp_path: Path, make: Any, says: str) -> None:
    (tmp_path / "plain.sh").write_text("#!/bin/sh\n")
    program = make(tmp_path)
    with pytest.raises(InputError) as caught:
        watch.notify_argv(f"{program} --flag", None)
    assert says in str(caught.value) and program in str(caught.value) and "--notify" in str(caught.value)
    if "/" in program:
        assert "PATH" not in str(caught.value)  # a path is not looked up on PATH: do not send the user there


def test_an_executable_path_is_taken_as_it_is(tmp_path: Path) -> None:
    script = tmp_path / "notify.sh"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o700)
    assert watch.notify_argv(f"{script} a 'b c'", None) == [str(script), "a", "b c"]


def test_each_job_that_ends_gets_one_line_with_why_it_failed() -> None:
    out, ended = io.StringIO(), set()
    running = _status(job_id="a")
    watch.report_ends([running, _status(job_id="b", state=JobState.COMPLETED, done=True, succeeded=True)], ended, out)
    failed = _status(job_id="a", state=JobState.FAILED, done=True, reason="rank 1: killed by SIGKILL")
    watch.report_ends([failed, _status(job_id="b", state=JobState.COMPLETED, done=True, succeeded=True)], ended, out)
    assert out.getvalue().splitlines() == [
        "b (local) ended COMPLETED",
        "a (local) ended FAILED: rank 1: killed by SIGKILL",
    ]


# ------------------------------------------------------------------ digests

VERDICT = {
    "time": 1000.0,
    "step": 50,
    "verdict": "Hang at step 50 (phase step), found by n1 after 95 s. Rank 1 on n2 stalled in inject_hang.",
    "ranks": [{"rank": 1, "node": "n2", "state": "stalled"}, {"rank": 0, "node": "n1", "state": "collective"}],
}
GOODPUT = {"allocated_s": 120.0, "parts_s": {"productive": 90.0, "setup": 20.0, "lost": 10.0}, "effective_pct": 75.0,
           "lost_steps": 9, "running": True, "attempts": [{}, {}]}  # fmt: skip


def test_a_hang_digest_names_the_node_blamed_the_checkpoint_the_losses_goodput_and_the_commands() -> None:
    hung = _status(
        verdict=VERDICT,
        progress={"step": 50, "checkpoint_step": 40},
        losses=[3.0, 2.5, 2.0],
        goodput=GOODPUT,
    )
    assert watch.events_of(hung, 0) == ["hang"]
    record = watch.digest(hung, "hang")
    assert record["blamed_nodes"] == ["n2"] and record["checkpoint_step"] == 40 and record["losses"] == "█▄▁"
    assert record["verdict"] == "Hang at step 50 (phase step), found by n1 after 95 s"
    assert record["commands"]["diagnosis"] == "meshrun logs j1 --diagnosis" and "cancel" in record["commands"]
    text = record["text"].splitlines()
    assert text[0].startswith("j1 (local, n) hung: Hang at step 50") and "  blamed: n2" in text
    assert "newest checkpoint step 40, loss █▄▁" in text[2] and text[3].startswith("  goodput so far: 75% effective")


def test_each_failure_requeue_and_hang_is_one_digest_even_across_refreshes_and_watches(tmp_path: Path) -> None:
    refreshes = [
        _status(restarts=0),
        _status(restarts=0, verdict=VERDICT),  # the hang
        _status(restarts=1, verdict=VERDICT, reason="no progress (exit 76)"),  # requeued; the same verdict shown
        _status(restarts=1, verdict=VERDICT, reason="no progress (exit 76)"),
        _status(
            restarts=1,
            verdict=VERDICT,
            state=JobState.FAILED,
            done=True,
            reason="crash",
            progress={"checkpoint_step": 40},
        ),
    ]
    seen, out, first = watch.Seen(tmp_path / "seen.json"), io.StringIO(), {}
    for found in refreshes:
        watch.handle_digests([found], first, seen, None, out)
    heads = [line for line in out.getvalue().splitlines() if not line.startswith("  ")]
    assert heads == [
        "j1 (local, n) hung: Hang at step 50 (phase step), found by n1 after 95 s",
        "j1 (local, n) requeued (restart 1): no progress (exit 76)",
        "j1 (local, n) ended FAILED: crash",
    ]
    assert "  resume: meshrun resume j1" in out.getvalue()
    again = io.StringIO()  # a second watch (the same notified record) says none of them again
    watch.handle_digests(refreshes[-1:], {}, watch.Seen(tmp_path / "seen.json"), None, again)
    assert again.getvalue() == ""


def test_a_digest_reaches_the_notify_command_as_one_json_line(tmp_path: Path) -> None:
    got = tmp_path / "got.jsonl"
    script = tmp_path / "notify.sh"
    script.write_text(f"#!/bin/sh\ncat >> {got}\n")
    script.chmod(0o755)
    failed = _status(state=JobState.TIMEOUT, done=True, goodput=GOODPUT)
    watch.handle_digests([failed], {}, watch.Seen(tmp_path / "seen.json"), [str(script)], io.StringIO())
    (record,) = [json.loads(line) for line in got.read_text().splitlines()]
    assert record["event"] == "failed" and record["state"] == "TIMEOUT" and record["goodput"]["effective_pct"] == 75.0
    assert record["text"].startswith("j1 (local, n) ended TIMEOUT")
