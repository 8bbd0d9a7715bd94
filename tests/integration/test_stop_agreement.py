"""The stop flag's agreement with several real ranks: one rank signalled, every rank stops after the same step.

Two gloo ranks (`python -m meshrun.launcher RUN_DIR`, as torchrun starts them) train; SIGUSR1 goes to rank 1's
pid only, as when a signal reaches some ranks of a job before others. Rank 0, never signalled, must
learn it from the all-reduce at the step boundary: both save one checkpoint after the same step and
exit 75, and each rank's own heartbeat says which step it stopped after.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Optional

from meshrun.launcher.contract.exitcodes import EXIT_REQUEUE
from tests.helpers.ranks import TIMEOUT_S, make_run, start, tiny_train

STEPS = 400  # far more than it runs: the signal comes at step 3
STOP_TIMEOUT_S = 90  # the stop takes ~5 s; ranks that disagree hang in their collectives until killed


def heartbeat(run_dir: Path, rank: int) -> Optional[dict]:
    """This rank's progress file (wherever its node's folder is), or None before its first stamp."""
    for path in run_dir.rglob(f"progress/rank-{rank}.json"):
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):  # replaced atomically, but the folder may still be appearing
            return None
    return None


def wait_for_step(run_dir: Path, rank: int, step: int) -> dict:
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        beat = heartbeat(run_dir, rank)
        if beat and beat["step"] >= step:
            return beat
        time.sleep(0.05)
    raise AssertionError(f"rank {rank} never reached step {step}: {heartbeat(run_dir, rank)}")


def test_one_signalled_rank_stops_every_rank_after_the_same_step(tmp_path: Path, corpus: Path) -> None:
    run_dir = make_run(tmp_path, "stop", corpus, 2, train=tiny_train(steps=STEPS, eval_every=0))
    procs = start(run_dir, 2)
    try:
        beat = wait_for_step(run_dir, 1, 3)
        assert beat["pid"] == procs[1].pid  # the rank itself, not a wrapper around it
        os.kill(procs[1].pid, signal.SIGUSR1)
        signalled_at = heartbeat(run_dir, 1)["step"]  # type: ignore[index]
        outputs = [p.communicate(timeout=STOP_TIMEOUT_S)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    codes = [p.returncode for p in procs]
    assert codes == [EXIT_REQUEUE, EXIT_REQUEUE], (codes, outputs)

    last = [heartbeat(run_dir, rank) for rank in (0, 1)]
    stopped = last[0]["step"]  # type: ignore[index]
    assert [b["step"] for b in last] == [stopped, stopped], last  # type: ignore[index]
    assert all(b["phase"] == "checkpoint" for b in last), last  # type: ignore[index]
    assert signalled_at <= stopped < STEPS, (signalled_at, stopped)
    # Rank 0 was never signalled: it stopped on its peer's word, and says so.
    assert f"stopping after step {stopped} on a peer's signal" in outputs[0], outputs[0]
    # One checkpoint, after that step, complete: both ranks wrote their part of the same save.
    complete = [
        int(p.parent.name.split("-")[1]) for p in (run_dir / "checkpoints").glob("step-*/meshrun-complete.json")
    ]
    assert complete == [stopped], complete
