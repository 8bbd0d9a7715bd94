"""The planner's step time against the measured one, on `local` (CPU ranks, gloo), over a grid of models and layouts.

    .venv/bin/python bench/plan_accuracy.py [--steps N] [--quick]

First `meshrun doctor -c local --gpus-per-node 0` calibrates the planner, in a HOME of the bench's own (yours
is not touched); then each job of the grid is planned (`meshrun plan --json`: step_time_s, timed with that
calibration) and run (`meshrun submit --wait`), and its measured step time is the median of metrics.jsonl's
step_time_s after the first two logged steps (warm-up). It prints a row per job and the error distribution
(error = predicted / measured - 1), apart for the models the planner's CPU constants were fitted on and the
HELD_OUT ones; the goal: median |error| under 20%, worst under 50%. --quick runs
one small job of a few steps: CI's check that the bench runs (its errors mean little).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Optional

from meshrun_cli import REPO, isolated_env, meshrun

TINY = REPO / "examples" / "tiny.yaml"

MODELS = {  # name: the train.model keys the bench sets (vocab 256, 4 heads: tiny.yaml's)
    "L2-d128-s128": {"n_layers": 2, "d_model": 128, "seq_len": 128},
    "L4-d128-s128": {"n_layers": 4, "d_model": 128, "seq_len": 128},
    "L4-d256-s128": {"n_layers": 4, "d_model": 256, "seq_len": 128},
    "L4-d256-s256": {"n_layers": 4, "d_model": 256, "seq_len": 256},
}
HELD_OUT = {  # models the CPU constants (steptime.GLOO_COLLECTIVE_FACTOR) were not fitted on: reported apart
    "L2-d192-s64": {"n_layers": 2, "d_model": 192, "seq_len": 64},
    "L6-d128-s96": {"n_layers": 6, "d_model": 128, "seq_len": 96},
}
LAYOUTS = {  # name: the parallel keys (2 CPU ranks)
    "dp2-fsdp": {"dp": 2, "tp": 1, "pp": 1, "dp_mode": "fsdp"},
    "dp2-ddp": {"dp": 2, "tp": 1, "pp": 1, "dp_mode": "ddp"},
    "tp2": {"dp": 1, "tp": 2, "pp": 1, "dp_mode": "fsdp"},
    "pp2": {"dp": 1, "tp": 1, "pp": 2, "dp_mode": "fsdp"},
}
FIGURES = ("gemm_tflops", "intra_node_busbw_gbps", "allreduce_latency_us", "layer_overhead_us", "layer_element_ns")
"""What doctor measured that the step times follow from, printed with them."""
WARMUP_LOGGED = 2
"""Logged steps left out of the measured median (the first steps pay for allocations and first calls)."""


def sets(model: dict[str, int], layout: dict[str, object], steps: int, data: Path) -> list[str]:
    keys = [f"train.model.{k}={v}" for k, v in model.items()]
    keys += [f"parallel.{k}={v}" for k, v in layout.items()]
    keys += [f"train.steps={steps}", "train.log_every=1", "train.eval_every=0", f"data.path={data}"]
    keys += ["checkpoint.every=0"]
    return [item for key in keys for item in ("--set", key)]


def measured_step_s(run_dir: Path) -> Optional[float]:
    times = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("step_time_s"):
            times.append(float(record["step_time_s"]))
    kept = times[WARMUP_LOGGED:]
    return statistics.median(kept) if kept else None


def corpus(home: Path) -> Path:
    """The examples' token file: the user's when there is one (read only), else built in the bench's HOME."""
    mine = Path("~/.cache/meshrun/data/stdlib.u16").expanduser()
    if mine.is_file():
        return mine
    from meshrun.launcher.data.corpus import build_corpus

    out = home / "stdlib.u16"
    build_corpus(out, max_bytes=2_000_000)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="one small job of 5 steps (CI's check that it runs)")
    parser.add_argument("--home", type=Path, help="the bench's HOME, kept afterwards (default: a temporary one)")
    args = parser.parse_args()
    grid = [(m, lay) for m in {**MODELS, **HELD_OUT} for lay in LAYOUTS]
    if args.quick:
        grid, args.steps = [("L2-d128-s128", "dp2-ddp")], 5
    with tempfile.TemporaryDirectory(prefix="meshrun-plan-accuracy-") as folder:
        home = args.home or Path(folder)
        env = isolated_env(home)
        data = corpus(home)
        calibrated = meshrun(env, "doctor", "-c", "local", "--gpus-per-node", "0", "--storage-mib", "2")
        print(next(line for line in calibrated.splitlines() if line.startswith("calibration: ")))
        figures = json.loads((home / "state" / "meshrun" / "calibration" / "local.json").read_text())["local:cpu"]
        print("figures: " + ", ".join(f"{k} {v}" for k, v in figures.items() if k in FIGURES))
        print(f"{'model':<14} {'layout':<9} {'predicted s':>11} {'measured s':>10} {'error':>7}")
        errors: dict[str, list[float]] = {"fitted on": [], "held out": []}
        for model, layout in grid:
            keys = sets({**MODELS, **HELD_OUT}[model], LAYOUTS[layout], args.steps, data)
            plan = json.loads(meshrun(env, "plan", str(TINY), "-c", "local", "--json", *keys))
            out = meshrun(env, "submit", str(TINY), "-c", "local", "--wait", *keys)
            run_dir = Path(next(line.split(": ", 1)[1] for line in out.splitlines() if line.startswith("run dir: ")))
            measured = measured_step_s(run_dir)
            predicted = plan["step_time_s"]
            if measured is None or predicted is None:
                print(f"{model:<14} {layout:<9} {'-':>11} {'-':>10} {'-':>7}")
                continue
            error = predicted / measured - 1
            errors["held out" if model in HELD_OUT else "fitted on"].append(error)
            print(f"{model:<14} {layout:<9} {predicted:>11.4f} {measured:>10.4f} {error:>+7.0%}")
        for name, found in {**errors, "all": [e for part in errors.values() for e in part]}.items():
            if found:
                absolute = [abs(e) for e in found]
                print(
                    f"error over {len(found)} jobs ({name}): median |error| {statistics.median(absolute):.0%}, "
                    f"worst {max(absolute):.0%} (goal: under 20% and 50%)"
                )


if __name__ == "__main__":
    main()
