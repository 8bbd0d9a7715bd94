"""Seeded journeys of a user on the `local` cluster (tests/journeys/harness.py says what a journey is and which
invariants hold after every step). CI runs a few; MESHRUN_SOAK=1 runs MESHRUN_JOURNEYS of them (default 100), from seed
MESHRUN_JOURNEY_SEED (default 0).
A failure names its seed: `pytest 'tests/journeys/test_local_journeys.py::test_local_journey[seed7]'` replays it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers.cli import SOAK
from tests.helpers.shared import computed_once
from tests.journeys.harness import LOCAL, Journey, reference_losses

CI_SEEDS = (1, 2, 3)
FIRST_SEED = int(os.environ.get("MESHRUN_JOURNEY_SEED", "0"))
"""The soak's first seed: seeds it has not seen find what the usual 0-99 no longer can (7015 did)."""
SEEDS = range(FIRST_SEED, FIRST_SEED + int(os.environ.get("MESHRUN_JOURNEYS", "100"))) if SOAK else CI_SEEDS
# CI's few journeys are short (the suite's time is shared: every journey stays under 3 minutes in all);
# the soak's are longer.
STEPS_PER_JOURNEY = (5, 10) if SOAK else (4, 6)


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> dict[int, float]:
    """Every step's loss in one uninterrupted run of the journeys' job: what any job must log for that step."""
    losses = computed_once(
        tmp_path_factory, "local-journey-reference", lambda root: reference_losses(LOCAL, root, corpus)
    )
    return {int(step): loss for step, loss in losses.items()}  # once for all the session's workers


@pytest.mark.parametrize("seed", SEEDS, ids=lambda seed: f"seed{seed}")
def test_local_journey(seed: int, home: Path, corpus: Path, reference: dict[int, float]) -> None:
    journey = Journey(LOCAL, seed, home, corpus, reference)
    journey.run(journey.rng.randint(*STEPS_PER_JOURNEY))
    print(f"\nseed {seed}: " + "; ".join(line for line in journey.log if not line.startswith("meshrun status")))  # -s
