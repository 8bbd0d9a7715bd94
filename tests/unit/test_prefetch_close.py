"""The Prefetcher's close: a loop's end must not wait out the producer's put timeout."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from meshrun.launcher.data import dataset as dataset_module
from meshrun.launcher.data.dataset import Layout, Prefetcher, TokenDataset, TrainStream


def test_close_with_a_full_queue_returns_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """run_loop closes its Prefetcher when the loop ends, with the read-ahead queue full. The producer
    then sits in put(timeout=PUT_WAIT_S): close used to wait out that timeout (up to 100 ms per loop, 5% of a
    20-step benchmark round of ~100 ms steps); waking it makes close return at once. The put's wait is made
    30 s here, so a close that waits it out shows whatever the machine's load (a 50 ms bound did not)."""
    monkeypatch.setattr(dataset_module, "PUT_WAIT_S", 30.0)
    path = tmp_path / "tokens.u16"
    np.arange(20_000, dtype=np.uint16).__mod__(256).astype(np.uint16).tofile(path)
    stream = TrainStream(TokenDataset(str(path), 32, 0.1), Layout(8, 8, dp_rank=0, dp_size=1), seed=0)
    slowest = 0.0
    for _ in range(5):
        prefetch = Prefetcher(stream, depth=2)
        prefetch.next_step()
        deadline = time.monotonic() + 5
        while not prefetch._queue.full() and time.monotonic() < deadline:  # the producer is blocked in put
            time.sleep(0.005)
        time.sleep(0.02)
        start = time.perf_counter()
        prefetch.close()
        slowest = max(slowest, time.perf_counter() - start)
        assert not prefetch._thread.is_alive()
    assert slowest < 10, f"close took {slowest:.1f} s: it waited out the producer's put"
