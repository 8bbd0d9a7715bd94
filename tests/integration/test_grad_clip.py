"""train.grad_clip in the training loop: a real rank (`python -m meshrun.launcher RUN_DIR`, gloo) against steps
computed by hand.

Every layout test compares the trainer with a reference that shares its step, clipping included,
so a broken clip would pass them all. Here the reference is written out: the loss, the global norm
as the square root of every gradient's squares, the gradients multiplied by
min(1, grad_clip / (norm + 1e-6)) and one AdamW step. AdamW is blind to a gradient's scale at the
first step (m / sqrt(v) cancels it), so the runs part from the third step's loss on: the test
trains 6 steps.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from meshrun.launcher.contract.spec.job import Data, Train
from meshrun.launcher.data.dataset import Layout, TrainStream, open_dataset
from meshrun.launcher.train.model import GPT, loss_fn
from meshrun.launcher.train.optim import lr_at
from tests.helpers.ranks import finish, make_run, metrics, start, tiny_train

CLIP = 0.05  # far below the tiny model's norms (about 1-3 here): every step is clipped
STEPS = 6


def hand_steps(train: Train, corpus: Path) -> list[tuple[float, float]]:
    """(loss, norm before clipping) of each step, computed in this process without the engine."""
    torch.manual_seed(train.seed)
    model = GPT(train.model, seed=train.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": train.weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=train.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    dataset = open_dataset(Data(path=str(corpus)), train.model.seq_len)
    stream = TrainStream(dataset, Layout(train.global_batch, train.micro_batch, dp_rank=0, dp_size=1), train.seed)
    steps = []
    for step in range(1, train.steps + 1):
        micro_batches = stream.next_step()
        total = 0.0
        for x, y in micro_batches:
            loss = loss_fn(model(x), y)
            (loss / len(micro_batches)).backward()
            total += float(loss.detach())
        norm = float(torch.stack([p.grad.double().pow(2).sum() for p in params]).sum().sqrt())
        factor = min(1.0, train.grad_clip / (norm + 1e-6)) if train.grad_clip > 0 else 1.0
        for p in params:
            p.grad.mul_(factor)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, train)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        steps.append((total / len(micro_batches), norm))
    return steps


def test_a_small_grad_clip_changes_training_and_matches_a_clipped_step_by_hand(tmp_path: Path, corpus: Path) -> None:
    clipped = tiny_train(steps=STEPS, grad_clip=CLIP, global_batch=4, micro_batch=2, eval_every=0, lr=1e-2)
    unclipped = dataclasses.replace(clipped, grad_clip=0.0)
    runs = {
        "clipped": make_run(tmp_path, "clipped", corpus, 1, train=clipped),
        "unclipped": make_run(tmp_path, "unclipped", corpus, 1, train=unclipped),
    }
    procs = {name: start(run_dir, 1) for name, run_dir in runs.items()}  # both at once: their imports overlap
    for p in procs.values():
        finish(p)
    got = {name: [(m["loss"], m["grad_norm"]) for m in metrics(run_dir)] for name, run_dir in runs.items()}
    by_hand = hand_steps(clipped, corpus)

    assert len(got["clipped"]) == len(by_hand) == STEPS
    for step, ((loss, norm), (hand_loss, hand_norm)) in enumerate(zip(got["clipped"], by_hand), start=1):
        assert abs(loss - hand_loss) < 1e-5 * max(1.0, hand_loss), (step, loss, hand_loss)
        assert abs(norm - hand_norm) < 1e-4 * hand_norm, (step, norm, hand_norm)
        assert hand_norm > 2 * CLIP  # the clip did act on this step
    # The same first step (same weights, same batch); from the third on, clipping changed the weights.
    assert got["clipped"][0] == got["unclipped"][0]
    last_clipped, last_unclipped = got["clipped"][-1][0], got["unclipped"][-1][0]
    assert abs(last_clipped - last_unclipped) > 1e-3, (last_clipped, last_unclipped)
