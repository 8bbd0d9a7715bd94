"""meshrun's training loop against a minimal hand-written loop, measured in the same run (CPU, one process).

    .venv/bin/python bench/throughput.py [--steps N] [--rounds R] [--quick]

Both train the same GPT class on the same batches with AdamW, clipping and the same
LR schedule; the minimal loop holds its batches in memory and does nothing else. The
rounds alternate (meshrun, minimal, meshrun, ...) so drifts in machine load hit both;
the ratio is of the medians. Goal: >= 0.97. --quick times 2 steps x 1 round on a
small corpus: the same code, CI's check that the bench runs (its ratio means little).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from trainer_setup import corpus, single_rank_trainer, timed_steps  # noqa: E402

from meshrun.launcher.contract.spec.job import Data, JobSpec, Model, Resources, Train  # noqa: E402
from meshrun.launcher.data.dataset import TrainStream  # noqa: E402
from meshrun.launcher.train.metrics import MetricsLog  # noqa: E402
from meshrun.launcher.train.model import GPT, loss_fn  # noqa: E402
from meshrun.launcher.train.optim import build_optimizer, lr_at  # noqa: E402
from meshrun.launcher.train.trainer import Trainer  # noqa: E402

MODEL = Model(n_layers=4, d_model=128, n_heads=4, vocab_size=256, seq_len=128)


def job_for(data: Path, steps: int) -> JobSpec:
    train = Train(
        model=MODEL,
        steps=steps,
        global_batch=8,
        micro_batch=8,
        lr=1e-3,
        min_lr=1e-4,
        warmup_steps=5,
        log_every=10,
        seed=0,
    )
    return JobSpec(name="throughput", resources=Resources(tasks_per_node=1), train=train, data=Data(path=str(data)))


def meshrun_round(t: Trainer, first: int, steps: int, run_dir: Path) -> float:
    """Seconds for `steps` steps of the trainer's own loop (prefetch, step, metrics every log_every)."""
    metrics = MetricsLog(str(run_dir), enabled=True, steps=t.cfg.steps)
    elapsed = timed_steps(t, metrics, first, steps)
    metrics.close()
    return elapsed


def minimal_round(model: GPT, opt: torch.optim.Optimizer, batches: list, cfg: Train, first: int) -> float:
    """The hand-written loop: what anyone would write for one process."""
    start = time.perf_counter()
    for i, (x, y) in enumerate(batches):
        for group in opt.param_groups:
            group["lr"] = lr_at(first + i, cfg)
        loss = loss_fn(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    loss.item()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="2 steps x 1 round (CI's check that the bench runs)")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.rounds = 2, 1
    total = args.steps * (args.rounds + 1)
    with tempfile.TemporaryDirectory() as tmp:
        job = job_for(corpus(Path(tmp), 50_000 if args.quick else 400_000), total)
        cfg = job.trainer
        quiet = open("/dev/null", "w")
        with single_rank_trainer(job) as t:
            model = GPT(cfg.model, seed=cfg.seed)
            opt = build_optimizer(model.parameters(), cfg)
            stream = TrainStream(t.dataset, t.layout, cfg.seed)
            batches = [stream.next_step()[0] for _ in range(total)]  # the same windows the trainer reads
            ours, theirs, step = [], [], 1
            for round_ in range(args.rounds + 1):  # round 0 warms both up and is not counted
                real_stdout, sys.stdout = sys.stdout, quiet
                try:
                    a = meshrun_round(t, step, args.steps, Path(tmp) / "run")
                finally:
                    sys.stdout = real_stdout
                b = minimal_round(model, opt, batches[step - 1 : step - 1 + args.steps], cfg, step)
                step += args.steps
                if round_:
                    ours.append(a)
                    theirs.append(b)
    tokens = args.steps * cfg.global_batch * cfg.model.seq_len
    mine, base = statistics.median(ours), statistics.median(theirs)
    print(
        f"model {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, {args.steps} steps x "
        f"{args.rounds} rounds, torch threads {torch.get_num_threads()}"
    )
    print(f"meshrun loop : {tokens / mine:10,.0f} tokens/s  ({mine / args.steps * 1000:.1f} ms/step)")
    print(f"minimal loop : {tokens / base:10,.0f} tokens/s  ({base / args.steps * 1000:.1f} ms/step)")
    print(f"ratio        : {base / mine:.3f}  (goal >= 0.97)")


if __name__ == "__main__":
    main()
