"""Consolidate a sharded checkpoint into one safetensors file, for use outside meshrun.

    python -m launcher.export CHECKPOINT OUT.safetensors

CHECKPOINT is a step folder (`ROOT/step-N`) or a checkpoint root, whose newest complete
step is exported; if retention deletes that step while it loads (a run still saving
with a small `checkpoint.keep`), the then-newest one is taken instead. Runs in one process on any machine that can read the checkpoint (no GPU, no process
group): the model is rebuilt from the spec recorded in the checkpoint's marker and
its weights are loaded from the shards whatever (dp, tp, pp) layout saved them. A checkpoint of
the deepspeed engine (the marker's job says `train.engine: deepspeed`) is consolidated by
DeepSpeed's own code from its save in `step-N/deepspeed/`, whatever ZeRO stage sharded it.
The file holds the full model's parameters under their usual names, plus metadata
(step, model config) as safetensors' string map.
"""

from __future__ import annotations

import contextlib
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
from launcher import dsconfig, schema
from launcher.model import GPT
from launcher.spec import JobSpec

USAGE = "usage: python -m launcher.export CHECKPOINT OUT.safetensors"
ATTEMPTS = 5
_STEP = re.compile(r"^step-(\d+)(\.tmp)?$")
DEEPSPEED_TAG = "deepspeed"
"""The deepspeed engine's own save inside a step folder: save_checkpoint(step_dir, tag=DEEPSPEED_TAG)."""


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
        if job.trainer.engine == "deepspeed":
            state["model"] = deepspeed_weights(path, job, state["model"])
        else:
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
    tensors: dict[str, torch.Tensor] = {}
    for name, t in state["model"].items():
        t = t.detach().contiguous().cpu()
        # A tied head (output.weight) is the embedding's tensor; safetensors refuses shared storage, so the
        # file holds both names, the second as a copy: it loads into a GPT with strict=True either way.
        tensors[name] = t.clone() if any(t.data_ptr() == u.data_ptr() for u in tensors.values()) else t
    meta = {
        "format": "meshrun-gpt",
        "step": str(marker["step"]),
        "model": json.dumps(schema.to_plain(job.trainer.model), sort_keys=True),
    }
    return tensors, meta


def deepspeed_weights(path: Path, job: JobSpec, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The full model from DeepSpeed's own save in `path/deepspeed/`, by DeepSpeed's own consolidation.

    ZeRO 1-3: the fp32 master weights gathered from every rank's shards (zero_to_fp32, as DeepSpeed's
    own script does); ZeRO-0 keeps whole weights in the model states file. The engine wraps the GPT
    itself, so the names are the GPT's; loading into `like` (strict) proves it and keeps the native
    export's names, shapes and dtypes.
    """
    folder = Path(path) / DEEPSPEED_TAG
    try:
        if dsconfig.zero_stage(job) == 0:
            # DeepSpeed's pickle holds its config and client state besides tensors: not weights_only.
            states = torch.load(folder / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
            saved = states["module"]
        else:
            # The consolidation is CPU work: no accelerator probing (a warning, or CUDA set up on a GPU
            # login node). DeepSpeed logs to stdout, where the export's one line of output goes.
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
            with contextlib.redirect_stdout(sys.stderr):
                from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

                saved = get_fp32_state_dict_from_zero_checkpoint(str(path), tag=DEEPSPEED_TAG)
    except ImportError as exc:
        raise ckpt.CheckpointError(
            f"{path} was saved by the deepspeed engine and reading it needs DeepSpeed ({exc}); "
            "install it: pip install 'meshrun[deepspeed]'"
        ) from None
    missing, unexpected = set(like) - set(saved), set(saved) - set(like)
    if missing or unexpected:
        raise ckpt.CheckpointError(
            f"{folder}: DeepSpeed's weights do not match train.model (missing {sorted(missing)[:3]}, "
            f"unexpected {sorted(unexpected)[:3]}); export it with the spec it was trained with"
        )
    return {name: saved[name].to(like[name].dtype) for name in like}


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
