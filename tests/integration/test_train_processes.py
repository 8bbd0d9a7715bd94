"""Real torch.distributed ranks: `python -m launcher RUN_DIR` in separate processes over gloo.

Each rank gets the variables torchrun would set, as a cluster launcher does. The
model is tiny (2 layers, d_model 64, seq 64) so the file stays well under a minute
on 2 cores; most of the time is processes importing torch.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

from launcher.spec import (Data, JobSpec, Model, Parallel, Resources, RunInfo, RunSpec, Train,
                           write_run_spec)

TIMEOUT_S = 180
STEPS = 20
_STRIPPED = ("SLURM_", "SUBMITIT_", "TORCHELASTIC_")
_TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_run(root: Path, name: str, corpus: Path, world: int, *, micro: int = 2, mode: str = "fsdp",
             command: Optional[tuple[str, ...]] = None, env: Optional[dict[str, str]] = None,
             **parallel: int) -> Path:
    run_dir = root / name
    run_dir.mkdir()
    train = None if command else Train(
        model=Model(n_layers=2, d_model=64, n_heads=4, seq_len=64), steps=STEPS, global_batch=8,
        micro_batch=micro, lr=3e-3, min_lr=3e-4, warmup_steps=2, eval_every=10, seed=0)
    job = JobSpec(name=name, resources=Resources(tasks_per_node=world),
                  parallel=Parallel(dp=parallel.get("dp", world), tp=parallel.get("tp", 1),
                                    pp=parallel.get("pp", 1), dp_mode=mode),  # type: ignore[arg-type]
                  train=train, command=command, data=Data(path=str(corpus)), env=env or {})
    write_run_spec(RunSpec(job, RunInfo(cluster="local", scheduler="local", run_dir=str(run_dir))), run_dir)
    return run_dir


def rank_environ(rank: int, world: int, port: int) -> dict[str, str]:
    """A clean copy of this environment plus what torchrun would export for `rank`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_STRIPPED) and k not in _TORCHRUN}
    env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
               GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               OMP_NUM_THREADS="1")  # several ranks share 2 cores: one thread each avoids thrashing
    return env


def start(run_dir: Path, world: int) -> list[subprocess.Popen[str]]:
    port = free_port()
    return [subprocess.Popen([sys.executable, "-m", "launcher", str(run_dir)], env=rank_environ(r, world, port),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for r in range(world)]


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
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_data_parallel_trains_and_matches_one_process(tmp_path: Path, corpus: Path) -> None:
    runs = {"single": make_run(tmp_path, "single", corpus, 1, micro=4),
            "fsdp": make_run(tmp_path, "fsdp", corpus, 2, micro=2),
            "ddp": make_run(tmp_path, "ddp", corpus, 2, micro=4, mode="ddp")}
    # All three at once: their torch imports overlap, which is most of the wall time.
    procs = {name: start(run_dir, 2 if name != "single" else 1) for name, run_dir in runs.items()}
    outputs = {name: finish(p) for name, p in procs.items()}
    single, fsdp, ddp = (metrics(runs[n]) for n in ("single", "fsdp", "ddp"))

    assert [m["step"] for m in fsdp] == list(range(1, STEPS + 1))
    keys = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "elapsed_s", "tokens"}
    assert keys <= set(fsdp[0]) and "val_loss" in fsdp[9] and "val_loss" not in fsdp[0]
    assert fsdp[-1]["loss"] < fsdp[0]["loss"] - 1.0, [m["loss"] for m in fsdp]
    assert fsdp[-1]["tokens"] == STEPS * 8 * 64
    for other in (fsdp, ddp):
        for a, b in zip(single, other):
            assert abs(a["loss"] - b["loss"]) < 1e-5, (a["step"], a["loss"], b["loss"])
            assert abs(a["grad_norm"] - b["grad_norm"]) < 1e-4 * max(1.0, a["grad_norm"])
        assert abs(single[-1]["val_loss"] - other[-1]["val_loss"]) < 1e-5
    assert f"step {STEPS}/{STEPS} loss" in outputs["fsdp"][0]
    assert "step 1/" not in outputs["fsdp"][1]  # only rank 0 logs


def test_command_job_runs_the_users_program_with_torchrun_variables(tmp_path: Path, corpus: Path) -> None:
    script = tmp_path / "show.py"
    script.write_text("import os\nprint('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'],\n"
                      "      os.environ['MASTER_ADDR'], os.environ['GREETING'])\n")
    run_dir = make_run(tmp_path, "cmd", corpus, 2, command=(sys.executable, str(script)),
                       env={"GREETING": "hello there"})
    outputs = finish(start(run_dir, 2))
    # Each rank announces itself, then the user's program prints.
    assert [o.strip().splitlines()[-1] for o in outputs] == ["rank 0 of 2 127.0.0.1 hello there",
                                                             "rank 1 of 2 127.0.0.1 hello there"]
    assert [o.splitlines()[0].split()[:3] for o in outputs] == [["[meshrun]", "rank", "0/2"],
                                                                ["[meshrun]", "rank", "1/2"]]


def test_user_errors_exit_2_with_one_line(tmp_path: Path, corpus: Path, capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from launcher.__main__ import main
    for key in [k for k in os.environ if k.startswith(_STRIPPED) or k in _TORCHRUN]:
        monkeypatch.delenv(key)
    assert main(["launcher"]) == 2
    assert "usage: python -m launcher RUN_DIR" in capsys.readouterr().err

    three_d = make_run(tmp_path, "tp", corpus, 1, dp=1, tp=2)
    assert main(["launcher", str(three_d)]) == 2
    assert "later version" in capsys.readouterr().err

    missing = make_run(tmp_path, "missing", tmp_path / "nope.u16", 1)
    assert main(["launcher", str(missing)]) == 2
    assert "meshrun data" in capsys.readouterr().err
