"""Checkpoints and preemption with real ranks: exact resume, kill -9 during saves, resharding.

CPU, gloo, fp32, a tiny model; every rank is a real `python -m meshrun.launcher RUN_DIR` process.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import time
from pathlib import Path

import torch

from meshrun.launcher.contract.records import ckptdir
from meshrun.launcher.contract.spec.job import Checkpoint, Parallel
from meshrun.launcher.export.consolidate import consolidated_state
from meshrun.launcher.rank.preempt import EXIT_REQUEUE
from tests.helpers.cli import trials
from tests.helpers.ranks import (
    REPO,
    finish,
    make_run,
    metrics,
    start,
    start_script,
    tiny_train,
)

STEPS = 40


def _train(**kw: object):
    return tiny_train(**{"steps": STEPS, "eval_every": 0, "log_every": 1, **kw})


def _wait_for_step(run_dir: Path, step: int, procs: list[subprocess.Popen], timeout: float = 120) -> int:
    deadline = time.monotonic() + timeout
    while True:
        path = run_dir / "metrics.jsonl"
        if path.exists() and path.read_text().strip():
            last = max(
                json.loads(line).get("step", 0) for line in path.read_text().strip().splitlines() if line.endswith("}")
            )
            if last >= step:
                return last
        assert all(p.poll() is None for p in procs), "a rank exited before the step was reached"
        assert time.monotonic() < deadline, f"step {step} not reached"
        time.sleep(0.02)


def _final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    tensors, meta = consolidated_state(ckptdir.latest(run_dir / "checkpoints"))
    assert meta["step"] == str(STEPS)
    return tensors


def test_signal_to_one_rank_saves_requeues_and_resumes_bit_identically(tmp_path: Path, corpus: Path) -> None:
    kw = dict(train=_train(), checkpoint=Checkpoint(every=10, keep=2))
    ref, pre = make_run(tmp_path, "ref", corpus, 2, **kw), make_run(tmp_path, "pre", corpus, 2, **kw)
    ref_procs, pre_procs = start(ref, 2), start(pre, 2)
    stopped_near = _wait_for_step(pre, 3, pre_procs)
    pre_procs[1].send_signal(signal.SIGUSR1)  # one rank only, as a careless scheduler might
    outputs = [p.communicate(timeout=120)[0] for p in pre_procs]
    assert [p.returncode for p in pre_procs] == [EXIT_REQUEUE, EXIT_REQUEUE], outputs
    saved = ckptdir.complete_steps(pre / "checkpoints")[-1]
    assert stopped_near <= saved < STEPS and "stopping after step" in outputs[0]
    finish(start(pre, 2))  # the requeued job: resumes and finishes
    finish(ref_procs)
    ref_rows, pre_rows = metrics(ref), metrics(pre)
    assert [r["step"] for r in pre_rows] == list(range(1, STEPS + 1))  # no step lost or repeated
    assert [r["loss"] for r in pre_rows] == [r["loss"] for r in ref_rows]  # bit-identical
    a, b = _final_weights(ref), _final_weights(pre)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


PEER_LOST = ("closed by peer", "reset by peer", "Broken pipe")
"""What gloo says to a rank whose peer was killed while the two were in a collective."""


def _lost_its_peer(out: str) -> bool:
    """Whether a rank that ended by itself failed only because its peer was killed: its error line (the first
    failure rankfail records) names the lost connection, not a checkpoint that did not load."""
    errors = [line for line in out.splitlines() if line.startswith("meshrun launcher: error:")]
    return len(errors) == 1 and any(sign in errors[0] for sign in PEER_LOST)


def test_kill_9_during_saves_never_loads_a_partial_checkpoint(tmp_path: Path, corpus: Path) -> None:
    """Kills at random moments while a checkpoint is saved every step (3 in CI, 20 with MESHRUN_SOAK=1);
    each restart resumes from a checkpoint that loads, and the run then finishes."""
    rng = random.Random(1234)
    # Each trial moves ~3 steps on: 400 steps leave room for 20; in CI 40 do for 3 (the finish saves every
    # step too, and 400 saves were most of this test's 90 s there).
    total_steps = trials(40, 400)
    run = make_run(
        tmp_path,
        "kill",
        corpus,
        2,
        train=_train(steps=total_steps, log_every=1),
        checkpoint=Checkpoint(every=1, keep=2),
    )
    root, resumed_from = run / "checkpoints", 0
    for trial in range(trials(3)):
        procs = start(run, 2)
        _wait_for_step(run, resumed_from + 2, procs)  # past one fresh commit: the guard stays quiet
        time.sleep(rng.uniform(0.0, 0.25))
        victims = procs if trial % 2 else [procs[rng.randrange(2)]]  # the whole job, or one rank
        for p in victims:
            p.kill()
        time.sleep(0.05)
        for p in procs:  # what Slurm's kill-on-bad-exit does to the rest
            p.kill()
            out = p.communicate()[0]
            assert "Traceback" not in out or p.returncode == -9 or _lost_its_peer(out), out
        steps = ckptdir.complete_steps(root)
        assert steps, "no complete checkpoint survived"
        for step in steps:  # everything that looks complete loads
            consolidated_state(ckptdir.step_dir(root, step))
        resumed_from = steps[-1]
    outputs = finish(start(run, 2))
    assert f"resuming from step {resumed_from}" in outputs[0]
    assert metrics(run)[-1]["step"] == total_steps


def test_resharding_a_221_checkpoint_to_112_and_one_process(tmp_path: Path, corpus: Path) -> None:
    train = _train(steps=4, global_batch=8, micro_batch=2)
    src = make_run(
        tmp_path, "src", corpus, 4, train=train, checkpoint=Checkpoint(every=4), parallel=Parallel(dp=2, tp=2, pp=1)
    )
    finish(start(src, 4))
    saved, _ = consolidated_state(ckptdir.latest(src / "checkpoints"))
    probes = {}
    for name, world, par in (("pp2", 2, Parallel(dp=1, tp=1, pp=2)), ("one", 1, Parallel())):
        dst = make_run(tmp_path, name, corpus, world, train=train, parallel=par)
        probe = REPO / "tests/integration/reshard_probe.py"
        finish(start_script(probe, [str(dst), str(ckptdir.latest(src / "checkpoints"))], world))
        probes[name] = {}
        for part in dst.glob("probe-*.pt"):
            probes[name].update(torch.load(part))
    for name, loaded in probes.items():
        assert loaded.keys() == saved.keys(), name
        for key in saved:
            assert torch.equal(loaded[key], saved[key]), (name, key)
