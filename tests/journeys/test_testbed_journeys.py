"""Seeded journeys of a user on the real Slurm testbed (tests/journeys/harness.py): the local journeys' steps
and invariants, with Slurm's own endings: a preemption by a job of the `high` partition, kill -9 of the batch
shell, a rank or a node's sidecar (the testbed stages checkpoints on scratch: the sidecars copy them), submits
from project folders whose code changed (each job keeps its code snapshot). Two ways in: on the login node
(`testbed`), and from a laptop over SSH (`laptop`: every verb through the testbed's sshd, whose connections a
step kills). CI runs one of each; MESHRUN_SOAK=1 runs MESHRUN_TESTBED_JOURNEYS of each (default 15). The
test id replays one.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers.cli import SOAK
from tests.journeys.harness import LAPTOP, TESTBED, Journey, Site, reference_losses

CI_SEEDS = (101, 201)
SOAKED = int(os.environ.get("MESHRUN_TESTBED_JOURNEYS", "15"))
SEEDS = [*range(100, 100 + SOAKED), *range(200, 200 + SOAKED)] if SOAK else CI_SEEDS
STEPS_PER_JOURNEY = (4, 7) if SOAK else (3, 4)  # CI's two are short; the soak's longer


def site_of(seed: int) -> Site:
    """Seeds 100-199 on the login node, 200-299 from a laptop over SSH."""
    return LAPTOP if seed >= 200 else TESTBED


@pytest.fixture(scope="module")
def testbed_reference(
    testbed: dict[str, object], tmp_path_factory: pytest.TempPathFactory, corpus: Path
) -> dict[int, float]:
    """Every step's loss in one uninterrupted two-node run of the journeys' job on the testbed (the same
    job from a laptop trains the same numbers: the journey compares it with these)."""
    return reference_losses(TESTBED, tmp_path_factory.mktemp("testbed-reference"), corpus)


@pytest.mark.parametrize("seed", SEEDS, ids=lambda seed: f"{site_of(seed).name}-seed{seed}")
def test_testbed_journey(
    seed: int, testbed: dict[str, object], home: Path, corpus: Path, testbed_reference: dict[int, float]
) -> None:
    journey = Journey(site_of(seed), seed, home, corpus, testbed_reference)
    journey.run(journey.rng.randint(*STEPS_PER_JOURNEY))
    print(f"\nseed {seed}: " + "; ".join(line for line in journey.log if not line.startswith("meshrun status")))  # -s
