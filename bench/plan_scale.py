"""Planning, validating and rendering a 1024-node x 8-GPU job; expanding a 10,000-host hostlist.

    .venv/bin/python bench/plan_scale.py [--runs N] [--quick]

Baselines measured in the same run: the same work for a 1-node job, and a plain
list comprehension producing the same 10,000 names. --quick takes the median of 3
runs instead of 30 (same sizes: planning 1024 nodes takes milliseconds), which is what
tests/integration/test_bench_quick.py runs so that a planner change breaking the bench fails CI.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Callable

from meshrun.launcher.rank.env import expand_hostlist
from meshrun.submit.config.cluster import load_profile
from meshrun.submit.planning.plan import plan_file
from meshrun.submit.schedulers import backend
from meshrun.submit.schedulers.render import render

REPO = Path(__file__).resolve().parents[1]
SPEC = REPO / "examples" / "h100-8node.yaml"


def median_s(fn: Callable[[], object], runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def plan_and_render(overrides: list[str]) -> Callable[[], object]:
    profile = load_profile("h100-ndr")
    scheduler = backend(profile.scheduler)
    return lambda: render(plan_file(SPEC, profile, overrides, home="/home/u", run_dir="/r"), scheduler)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=30, help="median of this many runs per case")
    parser.add_argument("--quick", action="store_true", help="3 runs per case (CI's check that the bench runs)")
    args = parser.parse_args()
    runs = 3 if args.quick else args.runs
    # Validation runs whole global batches, so each layout validates on one global batch of sequences.
    big = [
        "resources.nodes=1024",
        "parallel.dp=2048",
        "parallel.tp=4",
        "train.global_batch=8192",
        "train.eval_sequences=8192",
    ]
    one = ["resources.nodes=1", "parallel.dp=2", "parallel.tp=4", "train.global_batch=512", "train.eval_sequences=512"]
    # The example profile allows 64 nodes; the benchmark lifts that limit in a copy.
    import meshrun.submit.planning.plan as plan_mod

    original = plan_mod.check_resources
    plan_mod.check_resources = lambda spec, cluster: cluster.partition(None)
    try:
        t_big = median_s(plan_and_render(big), runs)
        t_one = median_s(plan_and_render(one), runs)
    finally:
        plan_mod.check_resources = original
    print(
        f"plan+validate+render 1024 nodes x 8 GPUs: {t_big * 1e3:.2f} ms "
        f"(1 node: {t_one * 1e3:.2f} ms, ratio {t_big / t_one:.2f})"
    )

    text = "gpu-[00001-10000]"
    expected = [f"gpu-{i:05d}" for i in range(1, 10001)]
    assert expand_hostlist(text) == expected
    t_expand = median_s(lambda: expand_hostlist(text), runs)
    t_base = median_s(lambda: [f"gpu-{i:05d}" for i in range(1, 10001)], runs)
    mixed = "rack[1-10]-node[001-100]-ib,login[1-2]"
    t_mixed = median_s(lambda: expand_hostlist(mixed), runs)
    print(
        f"expand_hostlist 10,000 hosts: {t_expand * 1e3:.2f} ms "
        f"(plain list comprehension {t_base * 1e3:.2f} ms, ratio {t_expand / t_base:.2f}); "
        f"two bracket groups x 1,000 + list: {t_mixed * 1e3:.2f} ms"
    )


if __name__ == "__main__":
    main()
