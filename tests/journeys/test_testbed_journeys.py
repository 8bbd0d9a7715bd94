"""Seeded journeys of a user on the real Slurm testbed (tests/journeys/harness.py): the local journeys' steps
and invariants, with Slurm's own endings: a preemption by a job of the `high` partition, kill -9 of the batch
shell, a rank or a node's sidecar (the testbed stages checkpoints on scratch: the sidecars copy them). CI runs
one; MESHRUN_SOAK=1 runs MESHRUN_TESTBED_JOURNEYS of them (default 30). The seed in the test id replays one.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers.cli import SOAK
from tests.journeys.harness import TESTBED, Journey, reference_losses

CI_SEEDS = (101,)
SEEDS = range(100, 100 + int(os.environ.get("MESHRUN_TESTBED_JOURNEYS", "30"))) if SOAK else CI_SEEDS
STEPS_PER_JOURNEY = (4, 7)


@pytest.fixture(scope="module")
def testbed_reference(
    testbed: dict[str, object], tmp_path_factory: pytest.TempPathFactory, corpus: Path
) -> dict[int, float]:
    """Every step's loss in one uninterrupted two-node run of the journeys' job on the testbed."""
    return reference_losses(TESTBED, tmp_path_factory.mktemp("testbed-reference"), corpus)


@pytest.mark.parametrize("seed", SEEDS, ids=lambda seed: f"seed{seed}")
def test_testbed_journey(
    seed: int, testbed: dict[str, object], tmp_path: Path, corpus: Path, testbed_reference: dict[int, float]
) -> None:
    journey = Journey(TESTBED, seed, tmp_path, corpus, testbed_reference)
    journey.run(journey.rng.randint(*STEPS_PER_JOURNEY))
    print(f"\nseed {seed}: " + "; ".join(line for line in journey.log if not line.startswith("meshrun status")))  # -s
