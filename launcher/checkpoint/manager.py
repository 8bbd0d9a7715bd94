"""The checkpoint manager: when to save, which checkpoint to resume from, and the crash-loop guard.

One object owns the checkpoint policy of a run (torchtitan's CheckpointManager shape):
- cadence: `due(step, last)` (every checkpoint.every steps and at the last step);
- the resume choice and the crash-loop guard (launcher/checkpoint/resume.py; rank 0 decides, all follow);
- saving and loading a Trainer: the engine writes its parts and the Trainer's (model, optimizer,
  scaler; step, data position, RNG), the Checkpointer (launcher/checkpoint/commit.py) commits atomically
  (marker last, rename) and applies retention, or stages on node-local scratch for the sidecar;
- the metrics event and the guard's reset on every commit.
A loop without checkpoints says so: `CheckpointManager.off(reason)`, never a silent skip.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch.distributed as dist

from meshrun.launcher.checkpoint import commit as ckpt
from meshrun.launcher.checkpoint import resume
from meshrun.launcher.checkpoint.commit import Checkpointer
from meshrun.launcher.contract.records import ckptdir
from meshrun.launcher.contract.records.rundir import RunDir, attempt_id, note_checkpoint, run_node_dir
from meshrun.launcher.contract.spec.job import RunSpec
from meshrun.launcher.contract.spec.schema import to_plain
from meshrun.launcher.rank.env import RankEnv
from meshrun.launcher.train import initweights
from meshrun.launcher.train.metrics import MetricsLog
from meshrun.launcher.train.trainer import Trainer

SHARED_LOOKUP_S = 5.0
"""How often rank 0 lists shared storage for the newest complete checkpoint when saves are staged on scratch."""


class CheckpointManager:
    """Every rank holds one; every rank calls the same methods at the same steps."""

    def __init__(self, saver: Optional[Checkpointer], run_spec: Optional[RunSpec], env: RankEnv, off: str = "") -> None:
        self.saver, self.run_spec, self.env = saver, run_spec, env
        self.off_reason = off
        """Why this run saves nothing ("" when it does)."""
        self.every = run_spec.job.checkpoint.every if run_spec else 0
        self._shared: Optional[int] = None
        self._looked_up = -SHARED_LOOKUP_S

    @classmethod
    def off(cls, env: RankEnv, reason: str) -> CheckpointManager:
        """A manager that never saves, for loops that must not (benches); `reason` says why."""
        return cls(None, None, env, off=reason)

    @classmethod
    def for_run(cls, run_spec: RunSpec, env: RankEnv, metrics: Optional[MetricsLog] = None) -> CheckpointManager:
        return cls(make_checkpointer(run_spec, env, metrics), run_spec, env)

    @property
    def enabled(self) -> bool:
        return self.saver is not None

    @property
    def last_committed(self) -> Optional[int]:
        return self.saver.last_committed if self.saver else None

    @property
    def shared_step(self) -> Optional[int]:
        """The checkpoint step a metrics line reports (status's CKPT): what resume can use. Saved straight to
        shared storage, the last commit; staged on scratch, the newest step complete on shared storage (the
        sidecar's copy), looked up by rank 0 at most every SHARED_LOOKUP_S (the other ranks' lines are not
        written)."""
        if self.saver is None or self.saver.stage_root is None:
            return self.last_committed
        if self.env.rank != 0:
            return None
        if time.monotonic() >= self._looked_up + SHARED_LOOKUP_S:
            steps = ckptdir.complete_steps(self.saver.root)
            self._shared, self._looked_up = (steps[-1] if steps else None), time.monotonic()
        return self._shared

    def due(self, step: int, last: int) -> bool:
        """A save after this step: every checkpoint.every steps, and always after the last one."""
        return self.enabled and (step == last or bool(self.every and step % self.every == 0))

    # ------------------------------------------------------------------ resume

    def resume(self, t: Trainer) -> Optional[int]:
        """The first step to run: 1, or one past the newest complete checkpoint (or the requested one);
        None when the crash-loop guard gave up."""
        if self.saver is None or self.run_spec is None:
            return fresh_start(t)
        choice = self._choose(self.saver.root, self.run_spec.job.checkpoint.resume_step)
        if self.env.rank == 0:
            print(f"[meshrun] {choice.note}", flush=True)
        if choice.gave_up:
            return None
        if choice.step is None:
            return fresh_start(t)
        return self.load(t, ckptdir.step_dir(self.saver.root, choice.step)) + 1

    def load(self, t: Trainer, path: Path) -> int:
        """Restore the Trainer from complete checkpoint `path`; returns the step it was saved after."""
        assert self.saver is not None, "a manager that is off loads nothing"
        ckptdir.check_complete(path)
        parts = t.state_parts(0, with_rng=t.rng.key in ckpt.saved_keys(path))
        t.engine.load_checkpoint(self.saver, parts, path)
        return t.progress.step

    def _choose(self, root: Path, requested: Optional[int]) -> resume.Choice:
        """Rank 0 picks (and counts) the checkpoint; every rank gets the same choice."""
        box: list[Any] = [resume.choose(root, requested) if self.env.rank == 0 else None]
        if dist.is_initialized() and self.env.world_size > 1:
            dist.broadcast_object_list(box, src=0)
        return box[0]  # type: ignore[no-any-return]

    # ------------------------------------------------------------------ save

    def save(self, t: Trainer, step: int, val_loss: Optional[float] = None) -> None:
        """Start saving step N (async per checkpoint.async_save); `val_loss` (the step's validation, for
        checkpoint.keep_best) goes into the marker, where retention and `export --best` find it."""
        if self.saver is None or self.run_spec is None:
            return
        info: dict[str, Any] = {
            "layout": {"dp": t.dims.dp, "tp": t.dims.tp, "pp": t.dims.pp},
            "engine": t.engine.name,
            "world_size": self.env.world_size,
            "restart_count": self.env.restart_count,
            "job": marker_job(self.run_spec),
        }
        if val_loss is not None:
            info[ckptdir.VAL_LOSS] = val_loss
        self.saver.save(step, t.engine.checkpoint_writer(self.saver, t.state_parts(step)), info)

    def save_now(self, t: Trainer, step: int, val_loss: Optional[float] = None) -> None:
        """Save step N unless it is the newest already, and wait until it is committed (before exiting)."""
        if self.saver is None:
            return
        if self.saver.last_committed != step:
            self.save(t, step, val_loss)
        self.saver.wait()

    def poll(self) -> None:
        """Commit a finished background save (cheap; at step boundaries)."""
        if self.saver is not None:
            self.saver.poll()

    def finish(self) -> None:
        """Wait for the save in flight (the end of training)."""
        if self.saver is not None:
            self.saver.wait()

    def close(self) -> None:
        if self.saver is not None:
            self.saver.close()


def fresh_start(t: Trainer) -> int:
    """Step 1 of a run with no checkpoint to resume: from train.init_from's weights when it names some
    (the deepspeed engine loaded them before DeepSpeed took the model: launcher/train/initweights.py)."""
    if t.cfg.init_from and t.engine.name != "deepspeed":
        initweights.start_from(t.engine.model, t.cfg.init_from, t.env.rank)
    return 1


def marker_job(run_spec: RunSpec) -> dict[str, Any]:
    """The job spec as the marker records it: everything but `env` (values a user may not want copied into
    every checkpoint; export needs none of it)."""
    return {key: value for key, value in to_plain(run_spec.job).items() if key != "env"}


def make_checkpointer(run_spec: RunSpec, env: RankEnv, metrics: Optional[MetricsLog] = None) -> Checkpointer:
    """Checkpoints get their own gloo group: an async save's collectives run in a background
    thread and must never interleave with the training thread's on the default group."""
    policy = run_spec.job.checkpoint
    group = dist.new_group(backend="gloo") if env.world_size > 1 else None
    root = Path(run_spec.run.checkpoint_dir or RunDir(run_spec.run.run_dir).default_checkpoints)
    staged = bool(run_spec.run.scratch_dir)
    on_commit = (
        _committed(root, metrics, staged, run_spec.run.run_dir) if env.rank == 0 and metrics is not None else None
    )
    saver = Checkpointer(
        root,
        keep=policy.keep,
        keep_every=policy.keep_every,
        async_save=policy.async_save,
        process_group=group,
        coordinator=env.rank == 0,
        on_commit=on_commit,
        # With node-local scratch the save is staged there (the stall pays for the fast disk only) and
        # the node's sidecar copies it to `root`; resume always reads `root`.
        stage_root=Path(run_node_dir(run_spec.run.run_dir, run_spec.run.scratch_dir, os.environ).staging)
        if staged
        else None,
        node_coordinator=env.local_rank == 0,
        attempt=attempt_id(os.environ),
        nodes=env.num_nodes,
        node_rank=env.node_rank,
    )
    saver.prepare()
    return saver


def _committed(root: Path, metrics: MetricsLog, staged: bool, run_dir: str) -> Callable[[int, float], None]:
    """Rank 0's reaction to every commit, whichever call commits it (a poll, the next save's
    wait, the final save, a save on a signal): the metrics event and the crash-loop guard.
    A save staged on scratch is not yet on shared storage: the sidecar's copier resets the guard
    when it commits there, and the event says "staged"."""

    def on_commit(step: int, stall_s: float) -> None:
        if not staged:
            resume.progress_made(root)  # a newer checkpoint: earlier failed resumes stop counting
            note_checkpoint(run_dir, step)  # on shared storage now (a staged one: when the copier commits it)
        event = {"event": "checkpoint", "checkpoint_step": step, "save_stall_s": round(stall_s, 4)}
        metrics.event({**event, **({"staged": True} if staged else {}), "time": time.time()})

    return on_commit
