"""The DeepSpeed config keys meshrun knows (DeepSpeed 0.19), and what a spec's `deepspeed:` section may do with
each. Torch-free, stdlib only: JobSpec's validation reads these tables on the laptop, before submission.

Every key DeepSpeed reads is in exactly one place:
- KNOWN: keys the section may set, each with its kind (checked cheaply: a bool is a bool, a size a number);
- REFUSED: keys the spec owns (the fix names the spec key), features meshrun's engine does not drive, and
  deprecated names (the fix names the key to use).
tests/unit/test_dsconfig.py checks both against the installed DeepSpeed (the top-level keys its config
reads; the pydantic models' fields of the sections checked here), so a DeepSpeed upgrade that adds or
renames a key fails a test instead of passing through unchecked.
"""

from __future__ import annotations

from typing import Any, Mapping

Kind = str
"""'bool', 'int', 'number', 'text', 'section', 'any'; a trailing '?' also allows null."""

ZERO = "zero_optimization"
OFFLOAD_OPTIMIZER = f"{ZERO}.offload_optimizer"
OFFLOAD_PARAM = f"{ZERO}.offload_param"

_PRECISION = "train.precision (fp32, bf16 or fp16): meshrun generates the bf16/fp16 sections from it"
_NATIVE = "use train.engine: native for it"
_UNDRIVEN = "a DeepSpeed feature meshrun's deepspeed engine does not drive; remove it"

TOP: dict[str, Kind] = {
    "steps_per_print": "int",
    "wall_clock_breakdown": "bool",
    "memory_breakdown": "bool",
    "dump_state": "bool",
    "disable_allgather": "bool",
    "disable_python_gc": "bool",
    "communication_data_type": "text?",
    "prescale_gradients": "bool",
    "gradient_predivide_factor": "number",
    "gradient_allreduce_op": "text",
    "log_level": "text?",
    "zero_allow_untested_optimizer": "bool",
    "zero_force_ds_cpu_optimizer": "bool",
    ZERO: "section",
    "bf16": "section",
    "fp16": "section",
    "comms_logger": "section",
    "flops_profiler": "section",
    "timers": "section",
    "tensorboard": "section",
    "wandb": "section",
    "csv_monitor": "section",
    "comet": "section",
}
"""Top-level keys a `deepspeed:` section may set (the sections not in SECTIONS pass through unchecked)."""

_ZERO_KEYS: dict[str, Kind] = {
    "contiguous_gradients": "bool",
    "reduce_scatter": "bool",
    "reduce_bucket_size": "int",
    "use_multi_rank_bucket_allreduce": "bool",
    "allgather_partitions": "bool",
    "allgather_bucket_size": "int",
    "overlap_comm": "bool?",
    "compute_grad_norm": "bool",
    "load_from_fp32_weights": "bool",
    "elastic_checkpoint": "bool",
    "offload_param": "section?",
    "offload_optimizer": "section?",
    "zenflow": "section?",
    "sub_group_size": "int",
    "ignore_unused_parameters": "bool",
    "legacy_stage1": "bool",
    "round_robin_gradients": "bool",
    "parameter_alignment": "bool",
    "zero_hpz_partition_size": "int",
    "zero_quantized_weights": "bool",
    "zero_quantized_nontrainable_weights": "bool",
    "zero_quantized_gradients": "bool",
    "memory_efficient_linear": "bool",
    "pipeline_loading_checkpoint": "bool",
    "override_module_apply": "bool",
    "log_trace_cache_warnings": "bool",
    "enable_sanity_checks": "bool",
    "save_muon_momentum_buffer_in_memory": "bool",
    "leaf_module": "section",
}
# ZeRO-3's keys, by the name DeepSpeed documents and by its field name (both are accepted).
_STAGE3: dict[str, Kind] = {
    "prefetch_bucket_size": "int",
    "param_persistence_threshold": "int",
    "model_persistence_threshold": "int",
    "max_live_parameters": "int",
    "max_reuse_distance": "int",
    "gather_16bit_weights_on_model_save": "bool",
    "module_granularity_threshold": "int",
    "use_all_reduce_for_fetch_params": "bool",
    "allgather_sequential": "bool",
}
_ZERO_KEYS.update(_STAGE3)
_ZERO_KEYS.update({f"stage3_{name}": kind for name, kind in _STAGE3.items()})
UNLISTED = frozenset(f"{ZERO}.{name}" for name in _STAGE3)
"""Accepted but left out of an error's list of valid keys: its documented stage3_ name is listed."""

_OFFLOAD_COMMON: dict[str, Kind] = {"nvme_path": "text?", "buffer_count": "int", "pin_memory": "bool"}

SECTIONS: dict[str, dict[str, Kind]] = {
    ZERO: _ZERO_KEYS,
    OFFLOAD_OPTIMIZER: {
        **_OFFLOAD_COMMON,
        "pipeline_read": "bool",
        "pipeline_write": "bool",
        "fast_init": "bool",
        "ratio": "number",
        "super_offload": "bool",
        "cpuadam_cores_perc": "number",
    },
    OFFLOAD_PARAM: {**_OFFLOAD_COMMON, "buffer_size": "int", "max_in_cpu": "int"},
    "bf16": {
        "immediate_grad_update": "bool",
        "check_grad_overflow": "bool",
        "bf16_master_weights_and_grads": "bool",
        "bf16_optimizer_states": "bool",
    },
    "fp16": {
        "auto_cast": "bool",
        "loss_scale": "number",
        "initial_scale_power": "int",
        "loss_scale_window": "int",
        "hysteresis": "int",
        "consecutive_hysteresis": "bool",
        "min_loss_scale": "int",
        "fp16_master_weights_and_grads": "bool",
    },
}
"""The sections whose keys are checked, by dotted path, each key with its kind."""

REFUSED: dict[str, str] = {
    # The spec owns these: one place for each setting, so a --set of the spec key can never disagree with a
    # copy of it here (refused even when the values agree today).
    "train_batch_size": "set train.global_batch (sequences per optimizer step) instead",
    "train_micro_batch_size_per_gpu": "set train.micro_batch instead",
    "gradient_accumulation_steps": "set train.global_batch and train.micro_batch instead "
    "(accumulation = global_batch / (micro_batch * dp))",
    "gradient_clipping": "set train.grad_clip instead (0 turns clipping off)",
    "optimizer": "meshrun builds AdamW from the spec: set train.lr and train.weight_decay instead",
    "scheduler": "meshrun builds the LR schedule from the spec: set train.lr, train.warmup_steps and train.min_lr",
    f"{ZERO}.stage": "set parallel.zero (0-3) instead",
    f"{ZERO}.cpu_offload": "set parallel.offload_optimizer: true instead",
    f"{ZERO}.cpu_offload_param": "set parallel.offload_params: true instead",
    f"{ZERO}.cpu_offload_use_pin_memory": "deprecated by DeepSpeed; set deepspeed.zero_optimization.offload_optimizer"
    ".pin_memory (or offload_param.pin_memory) instead",
    f"{ZERO}.stage3_gather_fp16_weights_on_model_save": "deprecated by DeepSpeed; set deepspeed.zero_optimization"
    ".gather_16bit_weights_on_model_save instead",
    f"{OFFLOAD_OPTIMIZER}.device": "set parallel.offload_optimizer: true (CPU) instead",
    f"{OFFLOAD_PARAM}.device": "set parallel.offload_params: true (CPU) instead",
    "bf16.enabled": f"set {_PRECISION}",
    "fp16.enabled": f"set {_PRECISION}",
    "bfloat16": f"set {_PRECISION}",
    "amp": f"set {_PRECISION}",
    "torch_autocast": f"set {_PRECISION}",
    "data_types": f"set {_PRECISION}",
    "activation_checkpointing": "set train.activation_checkpointing: true instead (meshrun's model checkpoints "
    "its own layers)",
    "checkpoint": "meshrun's checkpoint manager saves and resumes: set the spec's checkpoint.* keys instead",
    "nebula": "meshrun's checkpoint manager saves and resumes: set the spec's checkpoint.* keys instead",
    "datastates_ckpt": "meshrun's checkpoint manager saves and resumes: set the spec's checkpoint.* keys instead",
    "elasticity": "meshrun fixes the batch from train.global_batch and requeues on the same layout; remove it",
    "vocabulary_size": "set train.model.vocab_size instead",
    "pipeline": f"the deepspeed engine runs data parallelism (ZeRO) only; pipeline parallelism is parallel.pp: {_NATIVE}",
    "tensor_parallel": f"the deepspeed engine runs data parallelism (ZeRO) only; tensor parallelism is parallel.tp: "
    f"{_NATIVE}",
    "seq_parallel_communication_data_type": f"sequence parallelism is parallel.sequence_parallel: {_NATIVE}",
    "expert_parallel": _UNDRIVEN,
    "use_data_before_expert_parallelism": _UNDRIVEN,
    "aio": "meshrun offloads to CPU memory only (parallel.offload_optimizer, parallel.offload_params); remove it",
    "autotuning": _UNDRIVEN,
    "compile": _UNDRIVEN,
    "compression_training": _UNDRIVEN,
    "curriculum_learning": _UNDRIVEN,
    "data_efficiency": _UNDRIVEN,
    "dataloader_drop_last": "meshrun's data loader feeds the engine; remove it",
    "eigenvalue": _UNDRIVEN,
    "graph_harvesting": _UNDRIVEN,
    "hybrid_engine": _UNDRIVEN,
    "managed_gradient_accumulation": _UNDRIVEN,
    "progressive_layer_drop": _UNDRIVEN,
    "quantize_training": _UNDRIVEN,
    "sparse_attention": _UNDRIVEN,
    "sparse_gradients": _UNDRIVEN,
    "weight_quantization": _UNDRIVEN,
}
"""Dotted keys a `deepspeed:` section may not set, each with the fix."""

_KIND_TEXT = {
    "bool": "true or false",
    "int": "a whole number",
    "number": "a number",
    "text": "a string",
    "section": "a mapping of its keys",
    "any": "a value",
}


def fits(kind: Kind, value: Any) -> bool:
    """Whether `value` is of `kind` (a whole float counts as an int: YAML's 5.0e8 for a bucket size)."""
    base = kind.rstrip("?")
    if value is None:
        return kind.endswith("?") or base == "any"
    if base == "bool":
        return isinstance(value, bool)
    if base == "int":
        whole = isinstance(value, float) and value.is_integer()
        return not isinstance(value, bool) and (isinstance(value, int) or whole)
    if base == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if base == "text":
        return isinstance(value, str)
    if base == "section":
        return isinstance(value, Mapping)
    return True


def expected(kind: Kind, value: Any) -> str:
    """What a value of `kind` looks like, for an error's fix."""
    text = _KIND_TEXT[kind.rstrip("?")] + (" or null" if kind.endswith("?") else "")
    if kind.rstrip("?") in ("int", "number") and isinstance(value, str):
        text += " (YAML reads 5e8 as text: write 500000000 or 5.0e8)"
    return f"expected {text}"
