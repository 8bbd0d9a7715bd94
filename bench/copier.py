"""Checkpoints staged on scratch: the copier against `cp`, and the training stall against a save to shared.

    .venv/bin/python bench/copier.py [--scratch DIR] [--shared DIR] [--params-m 28] [--quick]

A real DCP checkpoint of a GPT + AdamW (>= 300 MB at the default size; --quick: ~2 MB, what CI
runs), saved once staged on "scratch", then:
- copier throughput: one node's part copied to the shared root as the sidecar's child does it
  (streamed sha256, fsync, read back and verified, done file) against `cp -r` of the same files to
  the same disk (goal: ratio >= 0.8), and against `cp -r` + `sync`, which is as durable. Best of 3
  each, every run into a fresh folder.
- the training stall: how long training waits for a save staged on scratch against one written
  straight to the shared root, for async saves (the default: a copy to CPU memory) and synchronous
  ones (the whole write). On one machine both folders may share a disk; on a cluster, point
  --scratch at node-local NVMe and --shared at the parallel file system.
Prints one table.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoint import build, state_bytes  # noqa: E402  (bench/checkpoint.py: the same model)

from meshrun.launcher.checkpoint import commit as ckpt  # noqa: E402
from meshrun.launcher.contract.records import ckptdir  # noqa: E402
from meshrun.launcher.sidecar import copier  # noqa: E402

ROUNDS = 3


def best(fn: Callable[[int], Any]) -> float:
    times = []
    for i in range(ROUNDS):
        start = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - start)
    return min(times)


def stalls(saver: ckpt.Checkpointer, state: Callable[[], dict[str, Any]], first: int) -> float:
    """The least time training waited for a save (a warm-up first: page cache, allocations)."""
    saver.save(first, ckpt.dcp_writer(saver, state()), {})
    saver.wait()
    waits = []
    for step in range(first + 1, first + 1 + ROUNDS):
        start = time.perf_counter()
        saver.save(step, ckpt.dcp_writer(saver, state()), {})
        waits.append(time.perf_counter() - start)
        saver.wait()
    return min(waits)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scratch", type=Path, default=None, help="node-local disk (default: a temp dir)")
    parser.add_argument("--shared", type=Path, default=None, help="shared storage (default: a temp dir)")
    parser.add_argument("--params-m", type=float, default=28.0, help="model size in millions of parameters")
    parser.add_argument("--quick", action="store_true", help="a ~2 MB state (CI's check that the bench runs)")
    args = parser.parse_args()
    layers, vocab = (2, 512) if args.quick else (8, 32768)
    if args.quick:
        args.params_m = 0.05
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model, opt = build(args.params_m, layers, vocab)

    def state() -> dict[str, Any]:
        msd, osd = get_state_dict(model, opt)
        return {"model": msd, "optim": osd}

    with tempfile.TemporaryDirectory(dir=args.scratch) as s, tempfile.TemporaryDirectory(dir=args.shared) as d:
        scratch, shared = Path(s), Path(d)
        rows = []
        for mode in ("async", "sync"):
            is_async = mode == "async"
            staged = ckpt.Checkpointer(shared / f"s-{mode}", keep=1, async_save=is_async, stage_root=scratch / mode)
            direct = ckpt.Checkpointer(shared / f"d-{mode}", keep=1, async_save=is_async)
            for saver in (staged, direct):
                saver.prepare()
            t_staged, t_direct = stalls(staged, state, 1), stalls(direct, state, 1)
            staged.close()
            direct.close()
            rows.append((f"{mode} save stall", f"{t_staged:.3f} s", f"{t_direct:.3f} s", t_staged / t_direct))
        part = ckptdir.step_dir(scratch / "sync", ckptdir.staged_steps(scratch / "sync")[-1])
        size = state_bytes(part)
        t_copy = best(lambda i: copier.copy_part(_fresh(part), shared / f"copy{i}", "bench", 0))
        t_cp = best(lambda i: subprocess.run(["cp", "-r", str(part), str(shared / f"cp{i}")], check=True))
        t_cp_sync = best(lambda i: _cp_sync(part, shared / f"cps{i}"))
        print(f"state: {size / 1e6:.0f} MB ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params + AdamW)")
        print(f"{'':24}{'scratch':>12}{'shared':>12}{'ratio':>8}")
        for name, a, b, ratio in rows:
            print(f"{name:24}{a:>12}{b:>12}{ratio:>8.2f}   (scratch / shared: the stall training pays)")
        rate = size / t_copy / 1e6
        print(f"{'':24}{'copier':>12}{'cp':>12}{'ratio':>8}")
        for name, t_base, note in (
            ("copy vs cp -r", t_cp, "goal >= 0.8; cp leaves the data in the page cache, unsynced"),
            ("copy vs cp -r + sync", t_cp_sync, "the same durability: both end with the data on disk"),
        ):
            base = f"{size / t_base / 1e6:.0f} MB/s"
            print(f"{name:24}{f'{rate:.0f} MB/s':>12}{base:>12}{t_base / t_copy:>8.2f}   ({note})")
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(shared, ignore_errors=True)
    dist.destroy_process_group()


def _cp_sync(part: Path, dest: Path) -> None:
    subprocess.run(["cp", "-r", str(part), str(dest)], check=True)
    subprocess.run(["sync", "-f", str(dest)], check=True)  # the file system holding the copy


def _fresh(part: Path) -> Path:
    """The staged part, not yet marked copied (each round copies it anew)."""
    (part / copier.COPIED).unlink(missing_ok=True)
    return part


if __name__ == "__main__":
    main()
