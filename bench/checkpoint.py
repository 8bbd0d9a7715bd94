"""Checkpoint cost, measured in one run against baselines from the same run.

    .venv/bin/python bench/checkpoint.py [--dir DIR] [--params-m 28] [--quick]

A GPT whose model + AdamW state is >= 200 MB (fp32: 12 bytes per parameter), one
process; --quick takes the same steps with a ~2 MB state (2 layers, d 64, vocab 512),
which is what CI runs to keep the bench working. Prints:
- the training stall of an async save (time until training may continue) over the
  time of a synchronous save of the same state (goal <= 0.1);
- save and load throughput against plain `cp -r` of the same bytes on the same disk.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict

from meshrun.launcher.checkpoint import commit as ckpt
from meshrun.launcher.contract.records import ckptdir
from meshrun.launcher.contract.spec.job import Model
from meshrun.launcher.train.model import GPT


def build(params_m: float, layers: int, vocab: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    d = 64
    while 12 * layers * d * d * 1.0 < params_m * 1e6:  # ~12 d^2 per block (attention 4, SwiGLU ~8)
        d += 64
    model = GPT(Model(n_layers=layers, d_model=d, n_heads=8, vocab_size=vocab, seq_len=256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.zeros(1, 16, dtype=torch.long)).float().mean().backward()
    opt.step()  # materialise AdamW's two moments
    return model, opt


def state_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--params-m", type=float, default=28.0, help="model size in millions of parameters")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--quick", action="store_true", help="a ~2 MB state (CI's check that the bench runs)")
    args = parser.parse_args()
    if args.quick:
        args.params_m, args.layers, args.vocab = 0.05, 2, 512
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model, opt = build(args.params_m, args.layers, args.vocab)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        sync = ckpt.Checkpointer(root / "sync", keep=3, async_save=False)
        asyn = ckpt.Checkpointer(root / "async", keep=3, async_save=True)
        for saver in (sync, asyn):
            saver.prepare()

        def state() -> dict:
            msd, osd = get_state_dict(model, opt)
            return {"model": msd, "optim": osd}

        sync.save(1, ckpt.dcp_writer(sync, state()), {})  # warm-up: page cache, first-call costs
        asyn.save(1, ckpt.dcp_writer(asyn, state()), {})
        asyn.wait()
        t_sync = min(timed(lambda s=s: sync.save(s, ckpt.dcp_writer(sync, state()), {})) for s in (2, 3))
        stalls, totals = [], []
        for step in (2, 3):
            start = time.perf_counter()
            asyn.save(step, ckpt.dcp_writer(asyn, state()), {})
            stalls.append(time.perf_counter() - start)
            asyn.wait()
            totals.append(time.perf_counter() - start)
        path = ckptdir.latest(root / "sync")
        size = state_bytes(path)
        t_cp = min(
            timed(lambda i=i: subprocess.run(["cp", "-r", str(path), str(root / f"cp{i}")], check=True))
            for i in range(2)
        )
        t_load = min(timed(lambda: sync.dcp_load(state(), path)) for _ in range(2))
        t_cat = min(
            timed(lambda: subprocess.run(f"cat {path}/* > /dev/null", shell=True, check=True)) for _ in range(2)
        )
        print(f"state: {size / 1e6:.0f} MB ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params + AdamW)")
        print(
            f"synchronous save: {t_sync:.2f} s ({size / t_sync / 1e6:.0f} MB/s); "
            f"cp -r of the same files: {t_cp:.2f} s ({size / t_cp / 1e6:.0f} MB/s); ratio save/cp {t_sync / t_cp:.2f}"
        )
        print(
            f"async save: training stalls {min(stalls):.3f} s, the save completes in {min(totals):.2f} s; "
            f"stall / synchronous save = {min(stalls) / t_sync:.3f} (goal <= 0.1)"
        )
        print(
            f"load: {t_load:.2f} s ({size / t_load / 1e6:.0f} MB/s); reading the same files: {t_cat:.2f} s; "
            f"ratio load/read {t_load / t_cat:.2f}"
        )
        shutil.rmtree(root, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
