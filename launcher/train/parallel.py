"""DeviceMesh, tensor parallelism (DTensor) and data parallelism (FSDP2 / replicate / DDP) for the GPT.

Applied in torchtitan's order on each rank's model part (a pipeline stage or the
whole model): tensor parallel first (parameters become DTensors on the tp mesh),
then data parallel on the dp mesh (FSDP2 adds the dp dimension to those DTensors).
The mesh is ("pp", "dp", "tp") with tp innermost, so a tp group is consecutive ranks
on one node (ParallelDims checks that tp divides the ranks per node).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from meshrun.launcher.contract.spec.parallel_dims import MESH_DIMS, ParallelDims
from meshrun.launcher.train.model import GPT
from meshrun.launcher.train.runtime import Runtime

# Under tensor parallelism the head's logits are gathered whole (ColwiseParallel, output Replicate), and the
# gather hands back a view; FSDP2 warns that an in-place op on the root module's output would skip its
# pre-backward hook. meshrun never changes the logits in place (the loss reads them: model.loss_fn), so the
# warning, printed on every rank of the last pipeline stage, has nothing to warn about here.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(.*\) returned a view tensor", category=UserWarning)


def build_mesh(dims: ParallelDims, runtime: Runtime) -> DeviceMesh:
    """The world as a ("pp", "dp", "tp") mesh; size-1 dimensions are kept so code never branches on them."""
    return init_device_mesh(runtime.device.type, dims.shape, mesh_dim_names=MESH_DIMS)


# ------------------------------------------------------------------ tensor parallel


class ReplicateParallel(ParallelStyle):
    """Keep a module whole on every tp rank, but as Replicate DTensors (torchtitan's NoParallel).

    Without sequence parallelism the norms are not split; making their weights DTensors
    anyway keeps every parameter of a layer on the same mesh, which FSDP2, the foreach
    optimizer and the gradient norm all need.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, None, input_fn=self._wrap, output_fn=self._unwrap)

    @staticmethod
    def _wrap(mod: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
        from torch.distributed.tensor import DTensor

        return tuple(
            DTensor.from_local(x, mesh, [Replicate()], run_check=False)
            if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
            else x
            for x in inputs
        )

    @staticmethod
    def _unwrap(mod: nn.Module, output: Any, mesh: DeviceMesh) -> Any:
        return output.to_local() if hasattr(output, "to_local") else output


def block_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """One block: heads split over tp (q/k/v column-wise, o row-wise), SwiGLU likewise (w1/w3 col, w2 row).

    With sequence parallelism the residual stream between the projections stays split
    over the sequence (Shard(1)); the norms run on their sequence shard, and the
    attention and MLP inputs are all-gathered (Megatron-SP).
    """
    seq = Shard(1)
    if not sequence_parallel:
        return {
            "attention_norm": ReplicateParallel(),
            "ffn_norm": ReplicateParallel(),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(),
        }
    return {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(
            input_layouts=(seq, None, None), desired_input_layouts=(Replicate(), None, None)
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=seq),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=seq),
    }


def apply_tensor_parallel(model: GPT, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Shard the model part over the tp mesh in place (parameters become DTensors)."""
    seq = Shard(1) if sequence_parallel else Replicate()
    top: dict[str, ParallelStyle] = {}
    if model.tok_embeddings is not None:  # vocab rows split; output whole (or sequence-split) activations
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if model.norm is not None:
        top["norm"] = SequenceParallel() if sequence_parallel else ReplicateParallel()
    if model.output is not None:  # vocab columns split; logits gathered whole for the plain loss
        top["output"] = ColwiseParallel(input_layouts=seq, output_layouts=Replicate())
    tied = model.output is not None and model.output.weight is getattr(model.tok_embeddings, "weight", None)
    if top:
        parallelize_module(model, tp_mesh, top)
    if tied:
        retie(model)
    plan = block_plan(sequence_parallel)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, plan)


def retie(model: GPT) -> None:
    """Make the head use the embedding's sharded matrix again (tie_embeddings under tp).

    parallelize_module distributes each module's parameters on its own, so the head got a second
    DTensor; both split the (vocab, d_model) matrix by vocabulary rows (Shard(0): the embedding
    row-wise, the head column-wise), so the embedding's shard is exactly the head's and one
    parameter serves both, as on one rank.
    """
    assert model.tok_embeddings is not None and model.output is not None
    embedding, head = model.tok_embeddings.weight, model.output.weight
    placements = getattr(embedding, "placements", None), getattr(head, "placements", None)
    if placements[0] != placements[1]:  # a bug in the plan above, not bad input
        raise RuntimeError(f"tied weights shard differently: embedding {placements[0]}, head {placements[1]}")
    model.output.weight = embedding


# ------------------------------------------------------------------ data parallel


def mixed_precision(runtime: Runtime) -> MixedPrecisionPolicy:
    """FSDP2 keeps fp32 master weights, computes in the amp dtype, and reduces gradients in fp32."""
    if runtime.amp_dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=runtime.amp_dtype, reduce_dtype=torch.float32)


def apply_data_parallel(model: GPT, mode: str, dims: ParallelDims, dp_mesh: DeviceMesh, runtime: Runtime) -> nn.Module:
    """Wrap the model part for data parallelism; returns the module to call (DDP wraps, FSDP2 does not).

    dp = 1 adds nothing (there is nothing to shard or reduce). fsdp: FSDP2 `fully_shard`
    per block, then the root. ddp: torch's DDP for a plain 1-D layout; with tp or pp it
    is FSDP2's `replicate` (DDP semantics built on FSDP2, which composes with DTensor
    and the pipeline schedules, where DDP does not).
    """
    if dims.dp == 1:
        return model
    if mode == "ddp" and dims.tp == 1 and dims.pp == 1:
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(
            model, device_ids=[runtime.device.index] if runtime.cuda else None, process_group=dp_mesh.get_group()
        )
    policy = mixed_precision(runtime)
    if mode == "ddp":
        from torch.distributed._composable.replicate_with_fsdp import replicate

        for block in model.layers.values():
            replicate(block, mesh=dp_mesh, mp_policy=policy)
        replicate(model, mesh=dp_mesh, mp_policy=policy)
        return model
    # Under pipelining a stage runs several forwards before their backwards: resharding after
    # each forward would all-gather the parameters again for every micro-batch's backward.
    reshard = dims.pp == 1
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard)
    return model
