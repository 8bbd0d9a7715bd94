"""Consolidate a sharded checkpoint into one safetensors file, for use outside meshrun.

    python -m launcher.export CHECKPOINT_DIR OUT.safetensors

Runs in one process on any machine that can read the checkpoint (no GPU, no process
group): the model is rebuilt from the spec recorded in the checkpoint's marker and
its weights are loaded from the shards whatever (dp, tp, pp) layout saved them.
The file holds the full model's parameters under their usual names, plus metadata
(step, model config) as safetensors' string map.
"""
from __future__ import annotations

import json
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


def consolidated_state(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The full model's tensors from a complete checkpoint, and metadata about them."""
    if not (Path(path) / ckpt.MARKER).is_file():
        raise ckpt.CheckpointError(f"{path} is not a complete checkpoint (no marker); export a complete one")
    marker = ckpt.read_marker(path)
    job = schema.load(JobSpec, marker["job"])
    model = GPT(job.trainer.model, seed=job.trainer.seed)
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    tensors = {name: t.detach().contiguous().cpu() for name, t in state["model"].items()}
    meta = {"format": "meshrun-gpt", "step": str(marker["step"]),
            "model": json.dumps(schema.to_plain(job.trainer.model), sort_keys=True)}
    return tensors, meta


def export(path: Path, out: Path) -> int:
    """Write OUT (atomically); returns the number of tensors."""
    from safetensors.torch import save_file

    tensors, meta = consolidated_state(path)
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp")
    save_file(tensors, str(tmp), metadata=meta)
    tmp.replace(out)
    return len(tensors)


def main(argv: Optional[list[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m launcher.export CHECKPOINT_DIR OUT.safetensors", file=sys.stderr)
        return 2
    try:
        count = export(Path(args[0]), Path(args[1]))
    except ckpt.CheckpointError as exc:
        print(f"meshrun export: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args[1]} ({count} tensors)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
