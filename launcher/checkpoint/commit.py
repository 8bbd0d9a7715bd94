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
import os
import shutil
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, cast

from meshrun.launcher.contract import private
from meshrun.launcher.contract.records import ckptdir
from meshrun.launcher.contract.records.rundir import node_name

Writer = Callable[[Path], Optional["Future[Any]"]]
"""An engine's writer: fills the folder it is given (`step-N.tmp/`) with a checkpoint's files; returns the
future of a write still under way (an async save), or None once everything is written."""


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
            private.make_private_dir(self.root)
            ckptdir.remove_stale(self.root)
        if self.stage_root is not None and self.node_coordinator:
            private.make_private_dir(self.stage_root)
            ckptdir.remove_stale(self.stage_root)  # staged steps stay: the copier decides about them
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
            private.make_private_dir(tmp)
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
                ckptdir.stage(
                    pending.tmp, ckptdir.step_dir(self.stage_root, pending.step), {**part, "step": pending.step}
                )
        elif self.coordinator:
            ckptdir.commit(pending.tmp, ckptdir.step_dir(self.root, pending.step), info)
            ckptdir.apply_retention(self.root, self.keep, self.keep_every)
        self.last_committed = pending.step
        if self.on_commit is not None:
            self.on_commit(pending.step, pending.stall_s)

    def dcp_load(self, state: dict[str, Any], path: Path) -> dict[str, Any]:
        """Load `state` in place from complete checkpoint `path` (DCP, on the checkpoint group); returns its marker."""
        dcp: Any = importlib.import_module("torch.distributed.checkpoint")  # its names are not re-exported for mypy

        ckptdir.check_complete(path)
        dcp.load(state, checkpoint_id=str(path), process_group=self.group)
        return ckptdir.read_marker(path)


def dcp_writer(saver: Checkpointer, state: dict[str, Any]) -> Writer:
    """The writer of a plain DCP checkpoint of `state` (the native engine's; tests and benches too)."""
    return lambda tmp: saver.dcp_save(state, tmp)


def saved_keys(path: Path) -> set[str]:
    """The state-dict keys a checkpoint holds (for optional per-rank entries such as RNG states)."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    return set(FileSystemReader(str(path)).read_metadata().state_dict_metadata)
