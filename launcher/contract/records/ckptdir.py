"""The checkpoint folder, as both sides read it: `step-N/` directories, the completeness marker written
last, what is complete, staged or best, and retention. Torch-free, stdlib only.

A checkpoint is either complete or ignored: a folder is one only once `meshrun-complete.json` is in it,
written last, fsynced, and the folder renamed from `step-N.tmp`. The writers (launcher/checkpoint/commit.py
on the ranks, the sidecar's copier) commit through `commit` and `stage` here; resume, export, status and
the end-of-run check read through `complete_steps`, `latest` and `resolve`.

Checkpoints are as private as the run dir, wherever they live (a cluster's shared checkpoint root
included): folders 0700, files 0600, set explicitly, whatever the umask.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Optional

from meshrun.launcher.contract import private

MARKER = "meshrun-complete.json"
VAL_LOSS = "val_loss"
"""The marker key of a checkpoint's validation loss (saved at an eval step with checkpoint.keep_best)."""
STAGED = "meshrun-staged.json"
"""A node's part of a save, complete on its node-local scratch (not yet a checkpoint anywhere)."""
_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_TMP_DIR = re.compile(r"^step-(\d{8,})\.tmp$")


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
    private.make_private_files(tmp)  # the shards, before they become a checkpoint anyone may read
    private.write_private(tmp / MARKER, json.dumps({**info, "committed_at": time.time()}, sort_keys=True), fsync=True)
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
    private.make_private_files(tmp)
    private.write_private(tmp / STAGED, json.dumps({**info, "staged_at": time.time()}, sort_keys=True), fsync=True)
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


def check_complete(path: Path) -> None:
    """Refuse a folder without the completeness marker (a partial save is never loaded)."""
    if not (Path(path) / MARKER).is_file():
        raise CheckpointError(f"{path} has no completeness marker: it is a partial save and is never loaded")
