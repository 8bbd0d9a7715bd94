"""The DeepSpeed engine's settings: checked with the spec, and its config generated from it. Torch-free.

Users keep one config: the spec. `generate(job)` turns its batch sizes, precision, clipping,
ZeRO stage and offload into a DeepSpeed config; the spec's `deepspeed:` section may add or
override other DeepSpeed keys, but never one the spec already sets. `check(job)` runs in
JobSpec's own validation, so a bad setting is refused before submission (exit 2, one line).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from launcher.schema import SchemaError

if TYPE_CHECKING:
    from launcher.spec import JobSpec

DEFAULT_ZERO = 2
"""The ZeRO stage when parallel.zero is unset (gradients and optimizer state sharded)."""


def zero_stage(job: JobSpec) -> int:
    return DEFAULT_ZERO if job.parallel.zero is None else job.parallel.zero


def check(job: JobSpec) -> None:
    """Refuse DeepSpeed settings that cannot work, naming the key, the value and the fix."""
    par = job.parallel
    deepspeed = job.train is not None and job.train.engine == "deepspeed"
    if not deepspeed:
        for key, value, default in (
            ("parallel.zero", par.zero, None),
            ("parallel.offload_optimizer", par.offload_optimizer, False),
            ("parallel.offload_params", par.offload_params, False),
        ):
            if value != default:
                raise SchemaError(
                    key,
                    value,
                    "applies to train.engine: deepspeed only; set train.engine: deepspeed, or remove it "
                    "(the native engine shards with parallel.dp_mode: fsdp is ZeRO-3-like)",
                )
        if job.deepspeed:
            raise SchemaError(
                "deepspeed",
                dict(job.deepspeed),
                "applies to train.engine: deepspeed only; set it or remove the section",
            )
        return
    for key, degree in (("parallel.tp", par.tp), ("parallel.pp", par.pp)):
        if degree > 1:
            raise SchemaError(
                key,
                degree,
                "the deepspeed engine runs data parallelism (ZeRO) only; use train.engine: native for tensor "
                f"and pipeline parallelism, or set {key}: 1",
            )
    stage = zero_stage(job)
    if stage not in (0, 1, 2, 3):
        raise SchemaError("parallel.zero", par.zero, "give a ZeRO stage 0, 1, 2 or 3")
    if par.offload_optimizer and stage == 0:
        raise SchemaError(
            "parallel.offload_optimizer", True, "optimizer offload needs ZeRO 1, 2 or 3; set parallel.zero: 2"
        )
    if par.offload_params and stage != 3:
        raise SchemaError(
            "parallel.offload_params", True, f"parameter offload needs ZeRO-3 (parallel.zero is {stage}); set zero: 3"
        )


def generate(job: JobSpec) -> dict[str, Any]:
    """The DeepSpeed config for this job: the spec's settings, then its `deepspeed:` keys."""
    cfg, par = job.trainer, job.parallel
    stage = zero_stage(job)
    zero: dict[str, Any] = {"stage": stage}
    if par.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if par.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    config: dict[str, Any] = {
        "train_batch_size": cfg.global_batch,
        "train_micro_batch_size_per_gpu": cfg.micro_batch,
        "gradient_accumulation_steps": cfg.global_batch // (cfg.micro_batch * par.dp),
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": cfg.precision == "bf16"},
        "fp16": {"enabled": cfg.precision == "fp16"},
        "steps_per_print": 2**31 - 1,  # meshrun logs the steps
        "wall_clock_breakdown": False,
    }
    return merge(config, dict(job.deepspeed))


def merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`overrides` over `base`, section by section."""
    out = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out
