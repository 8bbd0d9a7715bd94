"""Seeded journeys of a user on the real Slurm testbed (tests/journeys/harness.py): the local journeys' steps
and invariants, with Slurm's own endings: a preemption by a job of the `high` partition, kill -9 of the batch
shell, a rank or a node's sidecar (the testbed stages checkpoints on scratch: the sidecars copy them). CI runs
one; MESHRUN_SOAK=1 runs MESHRUN_TESTBED_JOURNEYS of them (default 30). The seed in the test id replays one.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers.cli import SOAK, meshrun, submitted
from tests.journeys.harness import TESTBED, Journey, losses_by_step, spec_args

CI_SEEDS = (101,)
SEEDS = range(100, 100 + int(os.environ.get("MESHRUN_TESTBED_JOURNEYS", "30"))) if SOAK else CI_SEEDS
STEPS_PER_JOURNEY = (4, 7)


@pytest.fixture(scope="module")
def testbed_reference(
    testbed: dict[str, object], tmp_path_factory: pytest.TempPathFactory, corpus: Path
) -> dict[int, float]:
    """Every step's loss in one uninterrupted two-node run of the journeys' job on the testbed."""
    home = tmp_path_factory.mktemp("testbed-reference")
    done = meshrun(home, "submit", *spec_args(TESTBED, corpus), "--wait", check=True)
    job_id, run_dir = submitted(done)
    losses = losses_by_step(run_dir, job_id)
    assert sorted(losses) == list(range(1, max(losses) + 1)) and len(losses) > 10, losses
    return losses


@pytest.mark.parametrize("seed", SEEDS, ids=lambda seed: f"seed{seed}")
def test_testbed_journey(
    seed: int, testbed: dict[str, object], tmp_path: Path, corpus: Path, testbed_reference: dict[int, float]
) -> None:
    journey = Journey(TESTBED, seed, tmp_path, corpus, testbed_reference)
    journey.run(journey.rng.randint(*STEPS_PER_JOURNEY))
    print(f"\nseed {seed}: " + "; ".join(line for line in journey.log if not line.startswith("meshrun status")))  # -s
