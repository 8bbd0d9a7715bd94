"""Checkpoints that are either complete or ignored.

A save writes `step-N.tmp/` with the engine's writer: torch.distributed.checkpoint for the native
engine (sharded, each rank its own part; async: training waits only for staging to CPU memory),
DeepSpeed's own save plus DCP for the trainer's state for the deepspeed engine. When every rank's
part is written (DCP's coordinator gathers the write results before it writes its
metadata, so its future completes last), the coordinator writes the completeness
marker last, fsyncs it and the directory, and renames `step-N.tmp` to `step-N`.
Resume takes the newest directory that has the marker; an unmarked one is never
loaded. At most one save is in flight. Retention keeps the newest K (and every
M-th step if asked, and with keep_best the one with the lowest recorded val_loss) and never
deletes the newest complete checkpoint.

Checkpoints are as private as the run dir, wherever they live (a cluster's shared
checkpoint root included): folders 0700, files 0600, set explicitly, whatever the umask.

With node-local scratch (`stage_root`), every rank saves into `STAGE/step-N.tmp` on its own
node; when DCP's save returns, every shard of every node is written (its final all_reduce
gathers every rank's write results, the coordinator writes `.metadata`, then broadcasts), so
each node coordinator marks its node's part staged (`meshrun-staged.json` last, fsync,
rename to `STAGE/step-N`). The sidecar's copier (launcher/sidecar/copier.py) then copies
every node's part to the shared root and commits it there with the same marker-last rule;
the trainer never waits for that copy. Resume always reads the shared root.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import re
import shutil
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, cast

from launcher.contract import private
from launcher.contract.rundir import node_name

# One place makes meshrun's files and folders private (launcher/contract/private.py); ckpt.X is how the trainer,
# the kit and the copier name them.
DIR_MODE, FILE_MODE = private.DIR_MODE, private.FILE_MODE
make_private_dir, make_private_files, write_private = (
    private.make_private_dir,
    private.make_private_files,
    private.write_private,
)

MARKER = "meshrun-complete.json"
VAL_LOSS = "val_loss"
"""The marker key of a checkpoint's validation loss (saved at an eval step with checkpoint.keep_best)."""
STAGED = "meshrun-staged.json"
"""A node's part of a save, complete on its node-local scratch (not yet a checkpoint anywhere)."""
_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_TMP_DIR = re.compile(r"^step-(\d{8,})\.tmp$")


Writer = Callable[[Path], Optional["Future[Any]"]]
"""An engine's writer: fills the folder it is given (`step-N.tmp/`) with a checkpoint's files; returns the
future of a write still under way (an async save), or None once everything is written."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: names it and says what to do."""


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def complete_steps(root: Path) -> list[int]:
    """Steps of the complete (marked) checkpoints under root, ascending."""
    return _marked_steps(root, MARKER)


def staged_steps(stage_root: Path) -> list[int]:
    """Steps whose part on this node's scratch is staged (marked), ascending."""
    return _marked_steps(stage_root, STAGED)


def _marked_steps(root: Path, marker: str) -> list[int]:
    root = Path(root)
    if not root.is_dir():
        return []
    steps = []
    for entry in root.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and (entry / marker).is_file():
            steps.append(int(match.group(1)))
    return sorted(steps)


def latest(root: Path) -> Optional[Path]:
    steps = complete_steps(root)
    return step_dir(root, steps[-1]) if steps else None


def resolve(root: Path, step: Optional[int] = None) -> Optional[Path]:
    """The checkpoint to resume from: the newest complete one, or exactly `step` (which must be complete)."""
    if step is None:
        return latest(root)
    path = step_dir(root, step)
    if step not in complete_steps(root):
        state = (
            "is incomplete (an interrupted save)"
            if (path.exists() or path.with_name(path.name + ".tmp").exists())
            else "does not exist"
        )
        have = ", ".join(map(str, complete_steps(root))) or "none"
        raise CheckpointError(f"checkpoint step {step} under {root} {state}; complete ones: {have}")
    return path


def read_marker(path: Path, marker: str = MARKER) -> dict[str, Any]:
    data = json.loads((Path(path) / marker).read_text())
    if not isinstance(data, dict):
        raise CheckpointError(f"{Path(path) / marker} is not a JSON object")
    return data


def retention_victims(steps: list[int], keep: int, keep_every: int = 0, best: Optional[int] = None) -> list[int]:
    """Which complete checkpoints retention deletes: all but the newest `keep`, the multiples of
    `keep_every` and `best`; never the newest one."""
    if not steps:
        return []
    kept = set(sorted(steps)[-max(keep, 1) :])
    if keep_every > 0:
        kept |= {s for s in steps if s % keep_every == 0}
    if best is not None:
        kept.add(best)
    return [s for s in sorted(steps) if s not in kept]


def lowest_val_loss(val_losses: dict[int, float]) -> Optional[tuple[int, float]]:
    """(step, val_loss) of the lowest value (the newer step on a tie); None when there is none."""
    if not val_losses:
        return None
    step = min(val_losses, key=lambda s: (val_losses[s], -s))
    return step, val_losses[step]


def best(root: Path) -> Optional[tuple[int, float]]:
    """The complete checkpoint whose marker records the lowest val_loss (checkpoint.keep_best)."""
    found: dict[int, float] = {}
    for step in complete_steps(root):
        try:
            value = read_marker(step_dir(root, step)).get(VAL_LOSS)
        except (OSError, ValueError, CheckpointError):
            continue  # unmarked by a concurrent retention, or unreadable: not a candidate
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            found[step] = float(value)
    return lowest_val_loss(found)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(tmp: Path, final: Path, info: dict[str, Any]) -> None:
    """Marker last, fsync, rename: after this returns the checkpoint is durable and complete."""
    make_private_files(tmp)  # the shards, before they become a checkpoint anyone may read
    write_private(tmp / MARKER, json.dumps({**info, "committed_at": time.time()}, sort_keys=True), fsync=True)
    fsync_dir(tmp)
    if (final / MARKER).is_file():
        # A complete twin from an earlier life of the job at the same step: keep it (replacing
        # it would leave a moment with no complete newest checkpoint).
        shutil.rmtree(tmp, ignore_errors=True)
        return
    if final.exists():  # an unmarked leftover cannot be loaded anyway
        shutil.rmtree(final)
    os.rename(tmp, final)
    fsync_dir(final.parent)


def stage(tmp: Path, final: Path, info: dict[str, Any]) -> None:
    """A node's part on its scratch: staged marker last, fsync, rename (replacing a leftover of that step)."""
    make_private_files(tmp)
    write_private(tmp / STAGED, json.dumps({**info, "staged_at": time.time()}, sort_keys=True), fsync=True)
    fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    fsync_dir(final.parent)


def remove_stale(root: Path) -> list[Path]:
    """Delete leftover `*.tmp` saves. Only call when no save is in flight (start-up)."""
    removed = []
    if Path(root).is_dir():
        for entry in Path(root).iterdir():
            if _TMP_DIR.match(entry.name) and entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry)
    return removed


def apply_retention(root: Path, keep: int, keep_every: int = 0) -> list[int]:
    """Delete what retention_victims names. The checkpoint with the lowest recorded val_loss is always
    kept: only keep_best jobs record one (so the sidecar's copier, which commits copies with the
    trainer's marker info, keeps it too without being told)."""
    lowest = best(root)
    victims = retention_victims(complete_steps(root), keep, keep_every, lowest[0] if lowest else None)
    for step in victims:
        path = step_dir(root, step)
        # Unmark first: a half-deleted directory must never look complete.
        (path / MARKER).unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)
    return victims


@dataclass
class _Pending:
    step: int
    tmp: Path
    future: Optional[Future[Any]]
    info: dict[str, Any]
    started: float
    stall_s: float = 0.0
    """How long training waited while this save started (the whole save when synchronous)."""


OnCommit = Callable[[int, float], None]
"""Called with (step, save stall in seconds) after each commit (with `stage_root`: after each node's
part is staged), whichever call finished it."""


class Checkpointer:
    """Saves and loads a DCP state dict under `root`. Every rank calls save/poll/wait/load."""

    def __init__(
        self,
        root: Path,
        keep: int,
        keep_every: int = 0,
        async_save: bool = True,
        process_group: Any = None,
        coordinator: bool = True,
        on_commit: Optional[OnCommit] = None,
        stage_root: Optional[Path] = None,
        node_coordinator: Optional[bool] = None,
        attempt: str = "",
        nodes: int = 1,
        node_rank: int = 0,
    ) -> None:
        """`stage_root`: this node's scratch staging folder (saves are staged there, the sidecar copies
        them to `root`); `node_coordinator`: this rank prepares and marks its node's part (local
        rank 0; default: `coordinator`); `attempt`, `nodes`, `node_rank` go into the staged marker."""
        self.root = Path(root)
        self.stage_root = Path(stage_root) if stage_root is not None else None
        self.node_coordinator = coordinator if node_coordinator is None else node_coordinator
        self.attempt, self.nodes, self.node_rank = attempt, nodes, node_rank
        self.keep, self.keep_every = keep, keep_every
        self.async_save = async_save
        self.group = process_group
        self.coordinator = coordinator
        self._pending: Optional[_Pending] = None
        self.last_save_stall_s = 0.0
        self.last_committed: Optional[int] = None
        """The newest step this Checkpointer finished: committed on `root`, or with `stage_root`
        staged on scratch (its shared copy is the sidecar's, and may still be under way)."""
        self._staging: Any = None
        self.on_commit = on_commit

    def prepare(self) -> None:
        """Start-up, on every rank: the coordinator clears interrupted saves; all agree after."""
        if self.coordinator:
            make_private_dir(self.root)
            remove_stale(self.root)
        if self.stage_root is not None and self.node_coordinator:
            make_private_dir(self.stage_root)
            remove_stale(self.stage_root)  # staged steps stay: the copier decides about them
        self._barrier()

    def _barrier(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier(group=self.group)

    def save(self, step: int, write: Writer, info: dict[str, Any]) -> None:
        """Start saving step N: `write` (the engine's) fills `step-N.tmp/`; waits for a save still in flight first."""
        self.wait()
        base = self.stage_root if self.stage_root is not None else self.root
        tmp = base / f"step-{step:08d}.tmp"
        if self.node_coordinator if self.stage_root is not None else self.coordinator:
            shutil.rmtree(tmp, ignore_errors=True)
            make_private_dir(tmp)
        self._barrier()
        began = time.perf_counter()
        self._pending = _Pending(step, tmp, write(tmp), info, began)
        self.last_save_stall_s = self._pending.stall_s = time.perf_counter() - began
        if self._pending.future is None:
            self._finish()

    def dcp_save(self, state: dict[str, Any], tmp: Path, asynchronous: Optional[bool] = None) -> Optional[Future[Any]]:
        """Write `state` into `tmp` with torch.distributed.checkpoint on the checkpoint group: in the background
        (training waits only for the copy to CPU memory) when async (checkpoint.async_save), else now."""
        dcp: Any = importlib.import_module("torch.distributed.checkpoint")  # its names are not re-exported for mypy

        if self.async_save if asynchronous is None else asynchronous:
            future = dcp.async_save(
                state, checkpoint_id=str(tmp), process_group=self.group, async_stager=self._stager()
            )
            return cast("Future[Any]", getattr(future, "upload_completion", future))  # AsyncSaveResponse on newer torch
        dcp.save(state, checkpoint_id=str(tmp), process_group=self.group)
        return None

    def _stager(self) -> Any:
        """One stager for the whole run: its CPU staging buffers are allocated once and reused, so
        the training stall of later saves is one memcpy, not an allocation plus page faults."""
        if self._staging is None:
            import torch
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            cuda = torch.cuda.is_available()
            self._staging = DefaultStager(
                StagingOptions(
                    use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=cuda
                )
            )
        return self._staging

    def close(self) -> None:
        """Finish the save in flight and free the staging buffers."""
        self.wait()
        if self._staging is not None:
            self._staging.close()
            self._staging = None

    @property
    def in_flight(self) -> bool:
        return self._pending is not None

    def poll(self) -> None:
        """Commit a finished async save (cheap; call at step boundaries)."""
        if self._pending and self._pending.future is not None and self._pending.future.done():
            self._finish()

    def wait(self) -> None:
        """Block until the save in flight is written and committed (before the next save, before exit)."""
        if self._pending:
            self._finish()

    def _finish(self) -> None:
        pending, self._pending = self._pending, None
        assert pending is not None
        if pending.future is not None:
            pending.future.result()  # re-raises a failed write: the .tmp stays unmarked, so ignored
        info = {**pending.info, "step": pending.step, "save_seconds": round(time.perf_counter() - pending.started, 3)}
        if self.stage_root is not None:
            # Every node's shards are written (see the module doc): each node marks its own part.
            # No shared commit and no retention here: the copier does both on shared storage.
            if self.node_coordinator:
                part = {
                    "attempt": self.attempt,
                    "node": node_name(os.environ),
                    "node_rank": self.node_rank,
                    "nodes": self.nodes,
                    "info": info,
                }
                stage(pending.tmp, step_dir(self.stage_root, pending.step), {**part, "step": pending.step})
        elif self.coordinator:
            commit(pending.tmp, step_dir(self.root, pending.step), info)
            apply_retention(self.root, self.keep, self.keep_every)
        self.last_committed = pending.step
        if self.on_commit is not None:
            self.on_commit(pending.step, pending.stall_s)

    def dcp_load(self, state: dict[str, Any], path: Path) -> dict[str, Any]:
        """Load `state` in place from complete checkpoint `path` (DCP, on the checkpoint group); returns its marker."""
        dcp: Any = importlib.import_module("torch.distributed.checkpoint")  # its names are not re-exported for mypy

        check_complete(path)
        dcp.load(state, checkpoint_id=str(path), process_group=self.group)
        return read_marker(path)


def dcp_writer(saver: Checkpointer, state: dict[str, Any]) -> Writer:
    """The writer of a plain DCP checkpoint of `state` (the native engine's; tests and benches too)."""
    return lambda tmp: saver.dcp_save(state, tmp)


def check_complete(path: Path) -> None:
    """Refuse a folder without the completeness marker (a partial save is never loaded)."""
    if not (Path(path) / MARKER).is_file():
        raise CheckpointError(f"{path} has no completeness marker: it is a partial save and is never loaded")


def saved_keys(path: Path) -> set[str]:
    """The state-dict keys a checkpoint holds (for optional per-rank entries such as RNG states)."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    return set(FileSystemReader(str(path)).read_metadata().state_dict_metadata)
