"""Consolidate a sharded checkpoint into one safetensors file, for use outside meshrun.

    python -m launcher.export CHECKPOINT OUT.safetensors

CHECKPOINT is a step folder (`ROOT/step-N`) or a checkpoint root, whose newest complete
step is exported; if retention deletes that step while it loads (a run still saving
with a small `checkpoint.keep`), the then-newest one is taken instead. Runs in one process on any machine that can read the checkpoint (no GPU, no process
group): the model is rebuilt from the spec recorded in the checkpoint's marker and
its weights are loaded from the shards whatever (dp, tp, pp) layout saved them.
The file holds the full model's parameters under their usual names, plus metadata
(step, model config) as safetensors' string map.
"""

from __future__ import annotations

import json
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Optional

import torch
import torch.distributed.checkpoint as dcp

from launcher import checkpoint as ckpt
from launcher import schema
from launcher.model import GPT
from launcher.spec import JobSpec

USAGE = "usage: python -m launcher.export CHECKPOINT OUT.safetensors"
ATTEMPTS = 5
_STEP = re.compile(r"^step-(\d+)(\.tmp)?$")


class OutputError(ValueError):
    """OUT cannot be written: names the path and the fix."""


class Vanished(ckpt.CheckpointError):
    """The checkpoint lost its marker while it was read (retention deleted it)."""


def _complete(root: Path) -> str:
    return ", ".join(map(str, ckpt.complete_steps(root))) or "none"


def missing_step(path: Path) -> ckpt.CheckpointError:
    """Why `path` is no checkpoint to export, in the user's terms (a step number, the root)."""
    match = _STEP.match(path.name)
    if match is None:
        return ckpt.CheckpointError(
            f"{path} is not a checkpoint: give a step folder (ROOT/step-N) or a checkpoint root"
        )
    step, root = int(match.group(1)), path.parent
    exists = ckpt.step_dir(root, step).exists() or ckpt.step_dir(root, step).with_suffix(".tmp").exists()
    state = (
        f"checkpoint step {step} under {root} is incomplete (an interrupted save)"
        if exists
        else f"no checkpoint step {step} under {root}"
    )
    return ckpt.CheckpointError(f"{state}; complete steps: {_complete(root)}")


def choose(path: Path) -> tuple[Path, bool]:
    """The step folder to export and whether it was picked as the newest (so may be retried)."""
    path = Path(path)
    if (path / ckpt.MARKER).is_file():
        return path, False
    if path.is_dir() and _STEP.match(path.name) is None:
        newest = ckpt.latest(path)
        if newest is None:
            raise ckpt.CheckpointError(f"no complete checkpoint under {path} yet")
        return newest, True
    raise missing_step(path)


def consolidated_state(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The full model's tensors from a complete checkpoint, and metadata about them."""
    if not (Path(path) / ckpt.MARKER).is_file():
        raise missing_step(Path(path))
    try:
        marker = ckpt.read_marker(path)
    except FileNotFoundError:
        raise Vanished(f"checkpoint {path} was deleted while it was read (retention: checkpoint.keep)") from None
    job = schema.load(JobSpec, marker["job"])
    model = GPT(job.trainer.model, seed=job.trainer.seed)
    state = {"model": model.state_dict()}
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, checkpoint_id=str(path), no_dist=True)
    except Exception:
        if not (Path(path) / ckpt.MARKER).is_file():  # retention unmarks before it deletes
            raise Vanished(
                f"checkpoint {path} was deleted while it was read (retention: checkpoint.keep); "
                f"complete steps now: {_complete(Path(path).parent)}"
            ) from None
        raise
    tensors = {name: t.detach().contiguous().cpu() for name, t in state["model"].items()}
    meta = {
        "format": "meshrun-gpt",
        "step": str(marker["step"]),
        "model": json.dumps(schema.to_plain(job.trainer.model), sort_keys=True),
    }
    return tensors, meta


def check_output(out: Path) -> Path:
    """OUT as an absolute file path whose folder exists and is writable (checked before any loading)."""
    out = Path(os.path.abspath(out))
    if out.is_dir():
        raise OutputError(f"{out}: is a directory; give a file name, e.g. {out / 'model.safetensors'}")
    if not out.parent.is_dir():
        raise OutputError(
            f"{out}: folder {out.parent} does not exist; create it (mkdir -p {out.parent}) or write elsewhere"
        )
    if not os.access(out.parent, os.W_OK | os.X_OK):
        raise OutputError(f"{out}: folder {out.parent} is not writable for you; write elsewhere")
    return out


def write_atomically(tensors: dict[str, torch.Tensor], meta: dict[str, str], out: Path) -> None:
    """A temporary file in OUT's own folder, then a rename: OUT is whole or untouched, nothing is left over."""
    from safetensors.torch import save_file

    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, out)
    except Exception as exc:  # safetensors reports I/O errors as its own (Rust) exception type
        tmp.unlink(missing_ok=True)
        raise OutputError(f"{out}: cannot be written ({exc}); check the path and free space") from None


def load_newest(path: Path) -> tuple[Path, dict[str, torch.Tensor], dict[str, str]]:
    """The chosen checkpoint's state; a newest-by-default one deleted mid-read is chosen again."""
    for attempt in range(ATTEMPTS):
        chosen, retry = choose(path)
        try:
            return (chosen, *consolidated_state(chosen))
        except ckpt.CheckpointError:
            if not retry or attempt == ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")


def export(path: Path, out: Path) -> tuple[int, Path]:
    """Write OUT (atomically); returns the number of tensors and the step folder exported."""
    out = check_output(Path(out))
    chosen, tensors, meta = load_newest(Path(path))
    write_atomically(tensors, meta, out)
    return len(tensors), chosen


def main(argv: Optional[list[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(USAGE, file=sys.stderr)
        return 2
    try:
        count, chosen = export(Path(args[0]), Path(args[1]))
    except (ckpt.CheckpointError, OutputError) as exc:
        print(f"meshrun export: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args[1]} ({count} tensors) from {chosen}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
