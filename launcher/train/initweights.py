"""train.init_from: start a run from existing weights (fine-tuning) instead of the seeded init.

The file is a safetensors file in meshrun's naming (`meshrun export`) or Hugging Face Llama's (an hf
export folder, or a Llama checkpoint of the same shape); launcher/contract/spec/weights.py has checked its names and
shapes before anything started. Every rank reads, one tensor at a time (memory-mapped: only that
tensor's bytes), the full tensors of the parameters it holds and keeps its slice: a pipeline stage reads
only its blocks, and a parameter sharded by FSDP2 or tensor parallelism (a DTensor) takes its local
shard of the full tensor, with no collective. So any layout of the native engine starts from the same
weights, and no rank ever holds more than its own parameters plus one full tensor.

The native engine loads when the checkpoint manager finds nothing to resume (a checkpoint wins). The
deepspeed engine loads into the GPT before `deepspeed.initialize` (ZeRO copies its fp32 master weights
and partitions then, so that is the one moment a plain copy reaches them); a resume then replaces them.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from meshrun.launcher.contract.spec import hfnames, weights
from meshrun.launcher.contract.spec.tokens import local_path


def file_names(path: Path) -> dict[str, Path]:
    """Every tensor of the init file(s) and the file holding it."""
    return {name: file for file in weights.weight_files(path) for name in weights.read_header(file)}


def name_in_file(name: str, hf: bool, held: dict[str, Path]) -> str:
    """Where the GPT's tensor `name` is in the file; a tied head saved without its own copy is the embedding."""
    ours = hfnames.to_hf(name) if hf else name
    if name == hfnames.HEAD and ours not in held:
        return hfnames.to_hf("tok_embeddings.weight") if hf else "tok_embeddings.weight"
    return ours


@torch.no_grad()
def load_into(model: nn.Module, path: Path) -> int:
    """Copy the file's tensors into `model` (a GPT or a stage of it, plain or sharded); returns the count."""
    held = file_names(path)
    hf = hfnames.is_hf(list(held))
    count = 0
    with ExitStack() as stack:
        from safetensors import safe_open

        handles: dict[Path, Any] = {}
        for name, param in model.named_parameters():  # a tied head is the embedding: named once
            source = name_in_file(name, hf, held)
            file = held[source]
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            full = handles[file].get_tensor(source).to(device=param.device, dtype=param.dtype)
            if isinstance(param, DTensor):  # every rank has the full tensor: slice locally, no collective
                full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.copy_(full)
            count += 1
    return count


def start_from(model: nn.Module, init_from: str, rank: int) -> None:
    """Load train.init_from into `model`, and say so in rank 0's log."""
    path = local_path(init_from)
    count = load_into(model, path)
    if rank == 0:
        naming = "Hugging Face Llama" if hfnames.is_hf(list(file_names(path))) else "meshrun"
        print(f"[meshrun] initialised {count} tensors from {init_from} ({naming} naming)", flush=True)
