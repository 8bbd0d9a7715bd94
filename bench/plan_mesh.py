"""Plan + mesh dry run of a 70B-shaped GPT on up to 8,192 ranks (1,024 nodes x 8 GPUs), and how it grows.

    .venv/bin/python bench/plan_mesh.py [--runs N] [--quick]

Each row plans the job (load, validate, the planner's model-state bytes: meshrun.submit.planning.plan + meshrun.submit.planning.estimate)
and runs the mesh dry run the way `meshrun plan --mesh` does (submit/planning/meshcheck.py: a subprocess of this
interpreter counting the real model split in a fake world of that many ranks). tp 8 and pp 8 stay fixed;
dp grows with the world. The baseline is the smallest world, measured in the same run: the ratio column
says how the time grows with the world size. "count" is the time inside the subprocess spent building and
splitting the stages; the rest of the wall time is starting Python and importing torch (the same for
every world size).
Goal: the 8,192-rank row under 10 s on 2 cores. --quick: a small model, 64 and 8,192 ranks, one run each
(what tests/integration/test_bench_quick.py runs, seconds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from meshrun.launcher.contract.spec.modelshape import StageBytes
from meshrun.launcher.contract.spec.schema import to_plain
from meshrun.submit.config.cluster import load_profile
from meshrun.submit.planning import estimate, meshcheck
from meshrun.submit.planning.plan import plan_file

SEVENTY_B = {"n_layers": 80, "d_model": 8192, "n_heads": 64, "vocab_size": 32000, "seq_len": 4096, "ffn_mult": 3.5}
SMALL = {"n_layers": 8, "d_model": 512, "n_heads": 8, "vocab_size": 32000, "seq_len": 512}
TP, PP = 8, 8


def spec_for(nodes: int, model: dict[str, Any]) -> dict[str, Any]:
    dp = nodes * 8 // (TP * PP)
    batch = max(dp, 1) * PP  # one micro-batch per pipeline stage per dp rank
    return {
        "name": f"plan-mesh-{nodes}",
        "resources": {"nodes": nodes, "gpus_per_node": 8, "time": "1-00:00:00"},
        "parallel": {"dp": dp, "tp": TP, "pp": PP, "dp_mode": "fsdp"},
        "train": {
            "model": model,
            "precision": "bf16",
            "global_batch": batch,
            "micro_batch": 1,
            "eval_sequences": batch,
        },
        "data": {"path": "/lustre/data/tokens.u16"},
    }


def planned_bytes(spec: Any) -> int:
    """The planner's largest per-rank model state (meshrun.submit.planning.estimate)."""
    return max(s.params + s.grads + s.optimizer for s in estimate.model_state_bytes(spec))


def one_run(path: Path) -> tuple[float, float, float, int, int]:
    """(plan s, mesh dry run wall s, in-subprocess count s, planned bytes, counted bytes) of one job."""
    profile = load_profile("h100-ndr")
    start = time.perf_counter()
    plan = plan_file(path, profile, home="/home/u", run_dir="/r")
    planned = planned_bytes(plan.spec)
    t_plan = time.perf_counter() - start
    start = time.perf_counter()
    stages, seconds = counted(plan.spec)
    t_mesh = time.perf_counter() - start
    return t_plan, t_mesh, seconds, planned, max(s.params + s.grads + s.optimizer for s in stages)


def counted(spec: Any) -> tuple[list[StageBytes], float]:
    """meshcheck.run's stages, and the count's own seconds from the JSON it printed."""
    done = subprocess.run(
        meshcheck.argv(sys.executable), input=json.dumps(to_plain(spec)), capture_output=True, text=True, check=True
    )
    return meshcheck.parse(done.stdout), float(json.loads(done.stdout.splitlines()[-1])["seconds"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3, help="median of this many runs per world size")
    parser.add_argument("--quick", action="store_true", help="small model, 64 and 8,192 ranks, one run each (CI)")
    args = parser.parse_args()
    runs, model = (1, SMALL) if args.quick else (args.runs, SEVENTY_B)
    node_counts = (8, 1024) if args.quick else (8, 64, 1024)
    # The example profile allows 64 nodes; the bench lifts that limit in this process (as plan_scale.py does).
    import meshrun.submit.planning.plan as plan_mod

    plan_mod.check_resources = lambda spec, cluster: cluster.partition(None)
    name = "70B" if model is SEVENTY_B else "small"
    print(f"{name} GPT, tp {TP} x pp {PP} x dp; median of {runs} run(s); MiB: the largest stage's model state per rank")
    print(
        f"{'ranks':>6} {'dp':>4}  {'plan ms':>8}  {'mesh s':>7}  {'count s':>7}  {'ratio':>6}  planned MiB  counted MiB"
    )
    base = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for nodes in node_counts:
            path = Path(tmp) / f"job-{nodes}.yaml"
            path.write_text(json.dumps(spec_for(nodes, model)))  # JSON is YAML
            results = [one_run(path) for _ in range(runs)]
            t_plan, t_mesh, t_count = (statistics.median(r[i] for r in results) for i in range(3))
            planned, counted_bytes = results[0][3], results[0][4]
            base = base or t_mesh
            print(
                f"{nodes * 8:>6,} {nodes * 8 // (TP * PP):>4}  {t_plan * 1e3:8.1f}  {t_mesh:7.2f}  {t_count:7.2f}  "
                f"{t_mesh / base:6.2f}  {planned / 2**20:11,.1f}  {counted_bytes / 2**20:11,.1f}"
            )
            total = t_plan + t_mesh
    print(f"plan + mesh dry run, {nodes * 8:,} ranks: {total:.2f} s (goal < 10 s)")


if __name__ == "__main__":
    main()
