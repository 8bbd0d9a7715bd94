"""Launching real ranks the way torchrun does: `python -m meshrun.launcher RUN_DIR` per rank, over gloo."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Optional

from meshrun.launcher.contract.spec.job import (
    Checkpoint,
    Data,
    JobSpec,
    Model,
    Parallel,
    Resources,
    RunInfo,
    RunSpec,
    Train,
    write_run_spec,
)

TIMEOUT_S = 180
STEPS = 20
_STRIPPED = ("SLURM_", "SUBMITIT_", "TORCHELASTIC_")
_TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_train(**overrides: object) -> Train:
    """The tiny trainer settings these tests share; keyword arguments override fields of Train."""
    base = dict(
        model=Model(n_layers=2, d_model=64, n_heads=4, seq_len=64),
        steps=STEPS,
        global_batch=8,
        micro_batch=2,
        lr=3e-3,
        min_lr=3e-4,
        warmup_steps=2,
        eval_every=10,
        seed=0,
    )
    base.update(overrides)
    return Train(**base)  # type: ignore[arg-type]


def make_run(
    root: Path,
    name: str,
    corpus: Path,
    world: int,
    *,
    micro: int = 2,
    mode: str = "fsdp",
    command: Optional[tuple[str, ...]] = None,
    env: Optional[dict[str, str]] = None,
    train: Optional[Train] = None,
    parallel: Optional[Parallel] = None,
    checkpoint: Optional[Checkpoint] = None,
    **dims: int,
) -> Path:
    """A run dir with spec.json for `world` CPU ranks on one node; `train`/`parallel` replace the defaults."""
    run_dir = root / name
    run_dir.mkdir()
    if train is None and not command:
        train = tiny_train(micro_batch=micro)
    if parallel is None:
        parallel = Parallel(dp=dims.get("dp", world), tp=dims.get("tp", 1), pp=dims.get("pp", 1), dp_mode=mode)  # type: ignore[arg-type]
    job = JobSpec(
        name=name,
        resources=Resources(tasks_per_node=world),
        parallel=parallel,
        train=None if command else train,
        command=command,
        data=Data(path=str(corpus)),
        env=env or {},
        checkpoint=checkpoint or Checkpoint(),
    )
    write_run_spec(RunSpec(job, RunInfo(cluster="local", scheduler="local", run_dir=str(run_dir))), run_dir)
    return run_dir


def rank_environ(rank: int, world: int, port: int) -> dict[str, str]:
    """A clean copy of this environment plus what torchrun would export for `rank`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_STRIPPED) and k not in _TORCHRUN}
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        GROUP_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )  # several ranks share 2 cores: one thread each avoids thrashing
    return env


def start(run_dir: Path, world: int) -> list[subprocess.Popen[str]]:
    """`world` ranks of `run_dir`'s job, forked from a process that imported torch once (tests/helpers/zygote.py;
    MESHRUN_TEST_NO_FORK=1 starts each with its own interpreter)."""
    from tests.helpers import zygote

    port = free_port()
    if not os.environ.get(zygote.DISABLED_ENV):
        argv = [str(Path(sys.modules["meshrun.launcher"].__file__ or "launcher").parent / "__main__.py"), str(run_dir)]
        return [zygote.spawn(argv, rank_environ(r, world, port)) for r in range(world)]
    return [
        subprocess.Popen(
            [sys.executable, "-m", "meshrun.launcher", str(run_dir)],
            env=rank_environ(r, world, port),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]


def start_script(script: Path, args: list[str], world: int, port: Optional[int] = None) -> list[subprocess.Popen[str]]:
    """`world` ranks of a test's own rank script (`python SCRIPT ARGS...` with torchrun's variables), forked like
    `start`'s ranks (MESHRUN_TEST_NO_FORK=1: each its own interpreter)."""
    from tests.helpers import zygote

    port = port or free_port()
    if not os.environ.get(zygote.DISABLED_ENV):
        return [zygote.spawn([str(script), *args], rank_environ(r, world, port), script=True) for r in range(world)]
    return [
        subprocess.Popen(
            [sys.executable, str(script), *args],
            env=rank_environ(r, world, port),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]


def finish(procs: list[subprocess.Popen[str]]) -> list[str]:
    """Wait for every rank; assert each exited 0 (showing its output if not)."""
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=TIMEOUT_S)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n{out}"
    return outputs


def metrics(run_dir: Path) -> list[dict]:
    """The step lines of metrics.jsonl (checkpoint events, lines of their own, are left out)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "event" not in r]


REPO = Path(__file__).resolve().parents[2]
