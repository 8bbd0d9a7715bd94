"""One rank of global-grad-norm checks: `python gradnorm_rank.py DPxTPxPP:MODE ...` with torchrun's variables.

For each layout (dp*tp*pp = the world size), in turn: every parameter of this rank's model part (tensor parallel, then data parallel, as the
trainer lays it out) gets a known gradient: a slice of a full gradient drawn from the
parameter's name, placed like the parameter. The rank prints one JSON line per layout: the norm
`global_grad_norm` returns, the norm of the full gradients of the whole model computed
in one process, and the collectives the norm ran (counted with the torch profiler).
"""

from __future__ import annotations

import json
import logging
import sys
import zlib

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.profiler import ProfilerActivity, profile

from meshrun.launcher.contract.spec.parallel_dims import ParallelDims
from meshrun.launcher.train.model import GPT, ModelConfig, ModelPart
from meshrun.launcher.train.optim import global_grad_norm
from meshrun.launcher.train.parallel import apply_data_parallel, apply_tensor_parallel, build_mesh
from meshrun.launcher.train.runtime import Runtime

CONFIG = ModelConfig(n_layers=4, d_model=64, n_heads=4, vocab_size=256, seq_len=32)
COLLECTIVES = ("allreduce", "all_reduce", "allgather", "all_gather", "reduce_scatter", "broadcast")


def full_grad(name: str, shape: torch.Size) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))


def reference_norm() -> float:
    """The whole model's norm in one process, in float64."""
    model = GPT(CONFIG, seed=0)
    squares = sum(full_grad(n, p.shape).double().pow(2).sum() for n, p in model.named_parameters())
    return float(torch.as_tensor(squares).sqrt())


def check(dims: ParallelDims, mode: str, runtime: Runtime) -> dict[str, object]:
    coords = dims.coordinates(dist.get_rank())
    mesh = build_mesh(dims, runtime)
    model = GPT(CONFIG, seed=0, part=ModelPart.stage(CONFIG, coords.pp, dims.pp))
    if dims.tp > 1:
        apply_tensor_parallel(model, mesh["tp"], sequence_parallel=True)
    apply_data_parallel(model, mode, dims, mesh["dp"], runtime)
    for name, p in model.named_parameters():
        full = full_grad(name, p.shape)
        p.grad = distribute_tensor(full, p.device_mesh, p.placements) if isinstance(p, DTensor) else full
    params = list(model.parameters())
    pp_group = mesh["pp"].get_group() if dims.pp > 1 else None
    global_grad_norm(params, runtime.device, pp_group)  # warm-up: meshes build their groups lazily
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        norm = global_grad_norm(params, runtime.device, pp_group)
    ran = [e.name for e in prof.events() if any(c in e.name.lower() for c in COLLECTIVES)]
    return {"norm": float(norm), "collectives": ran}


def main(layouts: list[str]) -> None:
    dist.init_process_group("gloo")
    runtime = Runtime(torch.device("cpu"), "gloo", None)
    reference = reference_norm()
    for layout in layouts:
        shape, mode = layout.split(":")
        dims = ParallelDims(*(int(n) for n in shape.split("x")))
        print(json.dumps({"layout": layout, "reference": reference, **check(dims, mode, runtime)}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    main(sys.argv[1:])
