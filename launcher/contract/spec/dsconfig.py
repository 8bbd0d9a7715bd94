"""The DeepSpeed engine's settings: checked with the spec, and its config generated from it. Torch-free.

Users keep one config: the spec. `generate(job)` turns its batch sizes, precision, clipping,
ZeRO stage and offload into a DeepSpeed config; the spec's `deepspeed:` section may add or
override other DeepSpeed keys, but never one the spec already sets. `check(job)` runs in
JobSpec's own validation, so a bad setting is refused before submission (exit 2, one line).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Mapping, Optional

from meshrun.launcher.contract.spec import dskeys
from meshrun.launcher.contract.spec.schema import SchemaError, closest

if TYPE_CHECKING:
    from meshrun.launcher.contract.spec.job import JobSpec

DEFAULT_ZERO = 2
"""The ZeRO stage when parallel.zero is unset (gradients and optimizer state sharded)."""


def zero_stage(job: JobSpec) -> int:
    return DEFAULT_ZERO if job.parallel.zero is None else job.parallel.zero


def uses_deepspeed(job: JobSpec) -> bool:
    """A trainer job on the deepspeed engine (a command job runs the user's own program)."""
    return job.train is not None and job.train.engine == "deepspeed"


def check(job: JobSpec) -> None:
    """Refuse DeepSpeed settings that cannot work, naming the key, the value and the fix (SchemaError)."""
    par = job.parallel
    if not uses_deepspeed(job):
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
    check_overrides(job)


def check_overrides(job: JobSpec) -> None:
    """The `deepspeed:` section against the known DeepSpeed keys (launcher/contract/spec/dskeys.py).

    Refused, naming the full key (`deepspeed.zero_optimization.stage`): a key the spec owns (batch sizes,
    clipping, ZeRO stage, offload device, precision, optimizer, scheduler), even when its value equals the
    spec's (one place per setting: a later `--set` of the spec key must not meet a stale copy here); a
    feature meshrun's engine does not drive; an unknown key (the fix lists the valid keys and the closest);
    a value of the wrong kind; a precision or offload section the spec does not turn on.
    """
    _check_section(job, "", job.deepspeed, dskeys.TOP)


def _check_section(job: JobSpec, path: str, section: Mapping[str, Any], known: Mapping[str, dskeys.Kind]) -> None:
    for key, value in section.items():
        dotted = f"{path}.{key}" if path else str(key)
        shown = f"deepspeed.{dotted}"
        if dotted in dskeys.REFUSED:
            raise SchemaError(shown, value, dskeys.REFUSED[dotted])
        if key not in known:
            hidden = dskeys.REFUSED.keys() | dskeys.UNLISTED
            valid = ", ".join(sorted(k for k in known if f"{path}.{k}".lstrip(".") not in hidden))
            raise SchemaError(
                shown, value, f"not a DeepSpeed key meshrun knows{closest(str(key), known)}; valid keys: {valid}"
            )
        if not dskeys.fits(known[key], value):
            raise SchemaError(shown, value, dskeys.expected(known[key], value))
        if dotted in dskeys.SECTIONS:
            if value is not None:  # its keys first: `bf16.enabled` names train.precision on its own
                _check_section(job, dotted, value, dskeys.SECTIONS[dotted])
            _check_applies(job, dotted, value)


def _check_applies(job: JobSpec, dotted: str, value: Any) -> None:
    """A precision or offload section only tunes what the spec turned on: refuse it otherwise (it would do
    nothing, or, for a null offload section, silently turn the spec's offload off)."""
    shown, precision, par = f"deepspeed.{dotted}", job.trainer.precision, job.parallel
    if dotted in ("bf16", "fp16") and precision != dotted:
        raise SchemaError(
            shown, value, f"applies with train.precision: {dotted} (it is {precision}); set that, or remove the section"
        )
    for section, spec_key, on in (
        (dskeys.OFFLOAD_OPTIMIZER, "parallel.offload_optimizer", par.offload_optimizer),
        (dskeys.OFFLOAD_PARAM, "parallel.offload_params", par.offload_params),
    ):
        if dotted == section and value is None:
            raise SchemaError(shown, value, f"set {spec_key}: false instead (the spec owns offload)")
        if dotted == section and not on:
            raise SchemaError(shown, value, f"tunes {spec_key}, which is off: set {spec_key}: true, or remove it")


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


def offload(offload_optimizer: bool, offload_params: bool) -> str:
    """What is offloaded to CPU memory, in words: 'optimizer', 'optimizer and parameter', 'parameter' or ''."""
    return " and ".join(name for name, on in (("optimizer", offload_optimizer), ("parameter", offload_params)) if on)


def summary(
    engine: str, zero: Optional[int], offload_optimizer: bool, offload_params: bool, dp_mode: str, dp: int = 1
) -> str:
    """The engine in one phrase: 'deepspeed ZeRO-2, optimizer offload', 'native (fsdp)', or 'native' where there is
    no data parallelism (dp 1: dp_mode does nothing)."""
    if engine != "deepspeed":
        return f"{engine} ({dp_mode})" if dp > 1 else engine
    moved = offload(offload_optimizer, offload_params)
    return f"deepspeed ZeRO-{DEFAULT_ZERO if zero is None else zero}" + (f", {moved} offload" if moved else "")


def job_summary(job: JobSpec) -> str:
    """`summary` of a validated spec."""
    par = job.parallel
    return summary(job.trainer.engine, par.zero, par.offload_optimizer, par.offload_params, par.dp_mode, par.dp)


def plain_summary(job: Mapping[str, Any]) -> Optional[str]:
    """`summary` of spec.json's `job` object as read back by status (any version, maybe garbled): None for
    a command job or what does not parse. Absent keys take the spec's defaults."""
    train, par = job.get("train"), job.get("parallel")
    if job.get("command") or not isinstance(train, Mapping) or not isinstance(par, Mapping):
        return None
    engine, zero, dp_mode, dp = (
        train.get("engine", "native"),
        par.get("zero"),
        par.get("dp_mode", "fsdp"),
        par.get("dp", 1),
    )
    flags = (par.get("offload_optimizer", False), par.get("offload_params", False))
    if not isinstance(engine, str) or not isinstance(dp_mode, str) or not all(isinstance(f, bool) for f in flags):
        return None
    if not isinstance(dp, int) or isinstance(dp, bool):
        return None
    if zero is not None and (not isinstance(zero, int) or isinstance(zero, bool)):
        return None
    return summary(engine, zero, flags[0], flags[1], dp_mode, dp)


def dumps(job: JobSpec) -> str:
    """The generated config as the run dir holds it (RunDir.DEEPSPEED_CONFIG): indented, for a person to read."""
    return json.dumps(generate(job), indent=2) + "\n"
