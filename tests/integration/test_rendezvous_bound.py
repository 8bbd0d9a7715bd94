"""The built-in trainer's rendezvous is bounded (watchdog.rendezvous_timeout_s): with one rank that never starts,
real `python -m meshrun.launcher RUN_DIR` ranks (gloo, this machine as two "nodes") end within the bound with exit 76 and
one line naming the rank and node that did not join, not torch's traceback after 10 minutes (a requeued
start waited in a store connect that could not complete)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from meshrun.launcher.contract.exitcodes import EXIT_NO_PROGRESS
from meshrun.launcher.contract.records.rundir import RunDir
from meshrun.launcher.contract.spec.job import (
    Data,
    JobSpec,
    Parallel,
    Resources,
    RunInfo,
    RunSpec,
    Watchdog,
    write_run_spec,
)
from tests.helpers.ranks import TIMEOUT_S, free_port, rank_environ, tiny_train

BOUND_S = 3.0
NODES = "n1,n2"


def _run_dir(root: Path, name: str, corpus: Path) -> Path:
    """Two nodes of one rank each, a 3 s rendezvous bound."""
    run_dir = root / name
    run_dir.mkdir()
    job = JobSpec(
        name=name,
        resources=Resources(nodes=2, tasks_per_node=1),
        parallel=Parallel(dp=2),
        train=tiny_train(),
        data=Data(path=str(corpus)),
        watchdog=Watchdog(rendezvous_timeout_s=BOUND_S),
    )
    write_run_spec(RunSpec(job, RunInfo(cluster="local", scheduler="local", run_dir=str(run_dir))), run_dir)
    return run_dir


def _start(run_dir: Path, rank: int, port: int) -> Any:
    """Rank `rank` of 2 as node `rank` of n1,n2 (one rank per node), forked like tests/helpers/ranks.start's."""
    import sys

    from tests.helpers import zygote

    env = rank_environ(rank, 2, port)
    env.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GROUP_RANK=str(rank), SLURM_STEP_NODELIST=NODES)
    argv = [str(Path(sys.modules["meshrun.launcher"].__file__ or "launcher").parent / "__main__.py"), str(run_dir)]
    return zygote.spawn(argv, env)


def test_a_rank_that_never_starts_is_named_within_the_bound(tmp_path: Path, corpus: Path) -> None:
    no_rank_1, no_rank_0 = _run_dir(tmp_path, "no-rank-1", corpus), _run_dir(tmp_path, "no-rank-0", corpus)
    started = time.monotonic()
    alone_0 = _start(no_rank_1, 0, free_port())  # rank 1 never starts: rank 0 serves the store and waits
    alone_1 = _start(no_rank_0, 1, free_port())  # rank 0 never starts: no store to reach
    try:
        out_0, _ = alone_0.communicate(timeout=TIMEOUT_S)
        out_1, _ = alone_1.communicate(timeout=TIMEOUT_S)
    finally:
        for rank in (alone_0, alone_1):
            if rank.poll() is None:
                rank.kill()
    took = time.monotonic() - started
    assert alone_0.returncode == EXIT_NO_PROGRESS, out_0
    assert alone_1.returncode == EXIT_NO_PROGRESS, out_1
    # torch's import and the tiny model's setup, then the 3 s bound (a client's connect retries overshoot it by
    # a few seconds): far below torch's own 10 minutes
    assert took < 90, took

    said_0 = "rendezvous: node n2 (rank 1) did not join within 3 s (watchdog.rendezvous_timeout_s)"
    assert said_0 in out_0 and "Traceback" not in out_0, out_0
    said_1 = "rendezvous: rank 1 could not reach rank 0's store at 127.0.0.1:"
    assert said_1 in out_1 and "node n1 (rank 0) did not join" in out_1 and "Traceback" not in out_1, out_1

    for run_dir, said in ((no_rank_1, said_0), (no_rank_0, "node n1 (rank 0) did not join")):
        run = RunDir(str(run_dir))
        assert said in Path(run.rank_error).read_text()  # what `meshrun status` shows as the first rank error
        assert Path(run.exit_code).read_text().strip() == str(EXIT_NO_PROGRESS)  # recorded even without rank 0
    heartbeat = next(Path(no_rank_1).rglob("rank-0.json"))  # the sidecar's view: this rank was at the rendezvous
    assert '"phase": "rendezvous"' in heartbeat.read_text() or '"phase":"rendezvous"' in heartbeat.read_text()
    assert os.path.exists(no_rank_1)
