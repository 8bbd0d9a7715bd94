"""The DeepSpeed config: generated from the spec, its `deepspeed:` overrides refused before submission when they
clash with the spec or are unknown, written into the run dir, and the engine visible in plan and status."""

from __future__ import annotations

import json
import time
import typing
from pathlib import Path
from typing import Any

import pytest

from meshrun.launcher.contract.records.rundir import RunDir
from meshrun.launcher.contract.spec import dsconfig, dskeys
from meshrun.launcher.contract.spec.job import JobSpec
from meshrun.launcher.contract.spec.schema import SchemaError, load
from meshrun.submit.config.cluster import load_profile
from meshrun.submit.core import findings
from meshrun.submit.planning.plan import describe
from meshrun.submit.planning.sweep import plan_sweep
from meshrun.submit.schedulers.base import run_dir_files
from meshrun.submit.transport.base import new_marker
from meshrun.submit.views.tables import detail_lines
from tests.helpers import builders
from tests.unit.test_cli_light import _run
from tests.unit.test_local_and_wait import _status

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "tiny.yaml"
DEEPSPEED = "train.engine=deepspeed"


def _job(deepspeed: dict[str, Any], **parallel: Any) -> JobSpec:
    data = {
        "name": "ds",
        "train": {"engine": "deepspeed", "global_batch": 16, "micro_batch": 4},
        "parallel": {"dp": 2, **parallel},
        "data": {"path": "/data/x.u16"},
        "deepspeed": deepspeed,
    }
    return load(JobSpec, data)


def _refused(deepspeed: dict[str, Any], **parallel: Any) -> SchemaError:
    with pytest.raises(SchemaError) as info:
        _job(deepspeed, **parallel)
    return info.value


# ------------------------------------------------------------------ the deepspeed: section, refused


@pytest.mark.parametrize(
    "section, key, spec_key",
    [
        ({"zero_optimization": {"stage": 1}}, "deepspeed.zero_optimization.stage", "parallel.zero"),
        ({"train_batch_size": 32}, "deepspeed.train_batch_size", "train.global_batch"),
        ({"train_micro_batch_size_per_gpu": 8}, "deepspeed.train_micro_batch_size_per_gpu", "train.micro_batch"),
        ({"gradient_accumulation_steps": 4}, "deepspeed.gradient_accumulation_steps", "train.global_batch"),
        ({"gradient_clipping": 0.5}, "deepspeed.gradient_clipping", "train.grad_clip"),
        ({"bf16": {"enabled": True}}, "deepspeed.bf16.enabled", "train.precision"),
        ({"fp16": {"enabled": True}}, "deepspeed.fp16.enabled", "train.precision"),
        ({"optimizer": {"type": "Adam"}}, "deepspeed.optimizer", "train.lr"),
        ({"scheduler": {"type": "WarmupLR"}}, "deepspeed.scheduler", "train.warmup_steps"),
        (
            {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}},
            "deepspeed.zero_optimization.offload_optimizer.device",
            "parallel.offload_optimizer",
        ),
        ({"zero_optimization": {"cpu_offload": True}}, "deepspeed.zero_optimization.cpu_offload", "offload_optimizer"),
        ({"pipeline": {"stages": 2}}, "deepspeed.pipeline", "train.engine: native"),
        ({"checkpoint": {"tag_validation": "Ignore"}}, "deepspeed.checkpoint", "checkpoint.*"),
    ],
)
def test_a_key_the_spec_owns_is_refused_naming_the_full_key_and_the_spec_key(
    section: dict[str, Any], key: str, spec_key: str
) -> None:
    error = _refused(section, offload_optimizer=True)
    assert error.key == key and spec_key in error.fix, str(error)


def test_the_same_value_the_spec_gives_is_refused_too() -> None:
    """One place per setting: a later --set train.global_batch must never meet a stale copy in deepspeed:."""
    error = _refused({"train_batch_size": 16, "zero_optimization": {"stage": 2}})
    assert error.key == "deepspeed.train_batch_size" and "train.global_batch" in error.fix


@pytest.mark.parametrize(
    "section, key, closest, listed",
    [
        ({"zero_optimizaton": {}}, "deepspeed.zero_optimizaton", "zero_optimization", "steps_per_print"),
        (
            {"zero_optimization": {"reduce_bucket_sise": 5}},
            "deepspeed.zero_optimization.reduce_bucket_sise",
            "reduce_bucket_size",
            "stage3_prefetch_bucket_size",
        ),
        ({"fp16": {"loss_scal": 0}}, "deepspeed.fp16.loss_scal", "loss_scale", "initial_scale_power"),
    ],
)
def test_an_unknown_key_names_the_closest_and_lists_the_valid_ones(
    section: dict[str, Any], key: str, closest: str, listed: str
) -> None:
    spec = {"precision": "fp16"} if "fp16" in section else {}
    with pytest.raises(SchemaError) as info:
        data = {"name": "ds", "train": {"engine": "deepspeed", **spec}, "data": {"path": "/d"}, "deepspeed": section}
        load(JobSpec, data)
    error = info.value
    assert error.key == key and f"did you mean {closest!r}?" in error.fix and listed in error.fix, str(error)
    assert "stage," not in error.fix and "enabled" not in error.fix  # the spec's keys are not offered


@pytest.mark.parametrize(
    "section, key, expected",
    [
        ({"zero_optimization": {"overlap_comm": "yes"}}, "deepspeed.zero_optimization.overlap_comm", "true or false"),
        ({"zero_optimization": {"reduce_bucket_size": "5e8"}}, "deepspeed.zero_optimization.reduce_bucket_size", "5e8"),
        ({"zero_optimization": {"sub_group_size": 1.5}}, "deepspeed.zero_optimization.sub_group_size", "whole number"),
        ({"steps_per_print": True}, "deepspeed.steps_per_print", "whole number"),
        ({"zero_optimization": 2}, "deepspeed.zero_optimization", "mapping"),
    ],
)
def test_a_value_of_the_wrong_kind_is_refused(section: dict[str, Any], key: str, expected: str) -> None:
    error = _refused(section)
    assert error.key == key and expected in error.fix, str(error)


def test_a_precision_or_offload_section_the_spec_does_not_turn_on_is_refused() -> None:
    error = _refused({"bf16": {"immediate_grad_update": True}})
    assert error.key == "deepspeed.bf16" and "train.precision: bf16 (it is fp32)" in error.fix
    error = _refused({"zero_optimization": {"offload_optimizer": {"pin_memory": False}}})
    assert error.key == "deepspeed.zero_optimization.offload_optimizer" and "parallel.offload_optimizer" in error.fix
    error = _refused({"zero_optimization": {"offload_optimizer": None}}, offload_optimizer=True)
    assert "parallel.offload_optimizer: false" in error.fix  # a null section would turn the spec's offload off


def test_the_existing_engine_checks_stay() -> None:
    assert _refused({}, tp=2).key == "parallel.tp"
    assert _refused({}, zero=4).key == "parallel.zero"
    assert _refused({}, zero=2, offload_params=True).key == "parallel.offload_params"
    with pytest.raises(SchemaError) as info:
        load(JobSpec, {"name": "n", "data": {"path": "/d"}, "deepspeed": {"steps_per_print": 10}})
    assert info.value.key == "deepspeed" and "train.engine: deepspeed" in info.value.fix


# ------------------------------------------------------------------ accepted: the generated config


def test_accepted_overrides_tune_the_generated_config_and_the_spec_keeps_its_keys() -> None:
    job = _job(
        {
            "zero_optimization": {
                "reduce_bucket_size": 5.0e8,
                "stage3_prefetch_bucket_size": 1000,
                "offload_optimizer": {"pin_memory": False},
            },
            "steps_per_print": 10,
            "tensorboard": {"enabled": False},
        },
        zero=3,
        offload_optimizer=True,
    )
    config = dsconfig.generate(job)
    assert config["train_batch_size"] == 16 and config["train_micro_batch_size_per_gpu"] == 4
    assert config["gradient_accumulation_steps"] == 2 and config["steps_per_print"] == 10
    zero = config["zero_optimization"]
    assert zero["stage"] == 3 and zero["reduce_bucket_size"] == 5.0e8 and zero["stage3_prefetch_bucket_size"] == 1000
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": False}
    assert json.loads(dsconfig.dumps(job)) == config and dsconfig.dumps(job).startswith('{\n  "')


# ------------------------------------------------------------------ the tables against the installed DeepSpeed


def _deepspeed() -> Any:
    # The tables do not depend on the accelerator: DeepSpeed's own detection stands (forcing cpu here would
    # leak into the later tests of a GPU session).
    return pytest.importorskip("deepspeed", exc_type=ImportError)


def _top_level_keys_deepspeed_reads() -> set[str]:
    """Every top-level key DeepSpeedConfig looks at, seen by handing it a dict that records each look."""
    _deepspeed()
    from deepspeed.runtime.config import DeepSpeedConfig

    seen: set[str] = set()

    class Keys(set):  # type: ignore[type-arg]
        def __contains__(self, key: object) -> bool:
            seen.add(str(key))
            return super().__contains__(key)

    class Spy(dict):  # type: ignore[type-arg]
        def get(self, key: Any, *default: Any) -> Any:
            seen.add(key)
            return super().get(key, *default)

        def __getitem__(self, key: Any) -> Any:
            seen.add(key)
            return super().__getitem__(key)

        def __contains__(self, key: object) -> bool:
            seen.add(str(key))
            return super().__contains__(key)

        def keys(self) -> Any:
            return Keys(super().keys())

    DeepSpeedConfig(Spy(train_batch_size=8, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2))
    return seen


def test_the_top_level_table_is_exactly_what_the_installed_deepspeed_reads() -> None:
    reads = _top_level_keys_deepspeed_reads()
    ours = set(dskeys.TOP) | {k for k in dskeys.REFUSED if "." not in k}
    assert not set(dskeys.TOP) & set(dskeys.REFUSED), "a key is both allowed and refused"
    assert ours == reads, (
        f"DeepSpeed reads but meshrun does not classify: {sorted(reads - ours)}; classified but not read: {sorted(ours - reads)}"
    )


def _kind(annotation: Any) -> str:
    """A pydantic field's annotation as a dskeys kind."""
    import enum
    import pathlib

    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if args and len(args) < len(typing.get_args(annotation)):
        return _kind(args[0]) + "?"
    if annotation is bool:
        return "bool"
    if annotation is int:
        return "int"
    if annotation is float:
        return "number"
    if (
        annotation is str
        or annotation is pathlib.Path
        or (isinstance(annotation, type) and issubclass(annotation, enum.Enum))
    ):
        return "text"
    return "section"


def _fields(model: Any) -> dict[str, str]:
    """The keys a DeepSpeed pydantic section accepts (field names and aliases), with their kinds."""
    found = {}
    for name, info in model.model_fields.items():
        for key in filter(None, (name, info.alias)):
            found[key] = _kind(info.annotation)
    return found


def test_the_checked_sections_match_the_installed_deepspeeds_models_key_for_key_and_kind_for_kind() -> None:
    _deepspeed()
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (
        DeepSpeedZeroOffloadOptimizerConfig,
        DeepSpeedZeroOffloadParamConfig,
    )

    models = {
        dskeys.ZERO: DeepSpeedZeroConfig,
        dskeys.OFFLOAD_OPTIMIZER: DeepSpeedZeroOffloadOptimizerConfig,
        dskeys.OFFLOAD_PARAM: DeepSpeedZeroOffloadParamConfig,
        "bf16": DeepSpeedBF16Config,
        "fp16": DeepSpeedFP16Config,
    }
    assert set(models) == set(dskeys.SECTIONS)
    for path, model in models.items():
        theirs = _fields(model)
        refused = {k.removeprefix(path + ".") for k in dskeys.REFUSED if k.rpartition(".")[0] == path}
        ours = dskeys.SECTIONS[path]
        assert set(ours) | refused == set(theirs), (path, sorted(set(theirs) - set(ours) - refused))
        assert not set(ours) & refused, path
        wrong = {k: (kind, theirs[k]) for k, kind in ours.items() if kind != theirs[k]}
        assert not wrong, (path, wrong)


def test_the_top_level_scalar_kinds_match_deepspeeds_defaults() -> None:
    _deepspeed()
    from deepspeed.runtime import constants

    names = {value: name for name, value in vars(constants).items() if isinstance(value, str) and name.isupper()}
    checked = 0
    for key, kind in dskeys.TOP.items():
        default = getattr(constants, f"{names.get(key)}_DEFAULT", None)
        if kind == "section" or default is None:
            continue
        assert dskeys.fits(kind, default), (key, kind, default)
        checked += 1
    assert checked >= 8


# ------------------------------------------------------------------ the CLI, the planner and status


def test_a_refused_key_through_the_cli_is_one_line_and_exit_2(tmp_path: Path, default_corpus: Path) -> None:
    args = ["submit", "examples/tiny.yaml", "-c", "local", "--set", DEEPSPEED]
    out = _run([*args, "--set", "deepspeed.zero_optimization.stage=1"], tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.count("\n") == 1 and "deepspeed.zero_optimization.stage: 1: set parallel.zero" in out.stderr
    out = _run([*args, "--dry-run", "--set", "deepspeed.zero_optimization.reduce_bucket_size=5e8"], tmp_path)
    assert out.returncode == 0, out.stderr  # --set parses 5e8 as a JSON number: accepted
    assert "engine=deepspeed, zero=2, offload=none" in out.stdout and "/deepspeed.json" in out.stdout


def test_the_planner_writes_the_generated_config_into_the_run_dir_and_describes_the_engine() -> None:
    plan = builders.plan(
        "tiny.yaml",
        "local",
        DEEPSPEED,
        "parallel.zero=3",
        "parallel.offload_optimizer=true",
        "parallel.offload_params=true",
    )
    files = run_dir_files(plan, "run.sh", "#!/bin/sh\n")
    written = json.loads(files[RunDir.DEEPSPEED_CONFIG].data)
    assert written == dsconfig.generate(plan.spec) and written["zero_optimization"]["stage"] == 3
    shown = describe(plan)
    assert {k: shown[k] for k in ("engine", "zero", "offload", "deepspeed_config")} == {
        "engine": "deepspeed",
        "zero": 3,
        "offload": "optimizer and parameter",
        "deepspeed_config": "/r/deepspeed.json",
    }
    assert "dp_mode" not in shown
    native = builders.plan("tiny.yaml", "local")
    assert RunDir.DEEPSPEED_CONFIG not in run_dir_files(native, "run.sh", "") and describe(native)["engine"] == "native"


def test_each_sweep_task_gets_its_own_config() -> None:
    plan = plan_sweep(TINY, load_profile("local"), [DEEPSPEED], ["parallel.zero=1,3"], home="/h", run_dir="/r")
    files = run_dir_files(plan, "run.sh", "")
    stages = [json.loads(files[f"tasks/{i}/deepspeed.json"].data)["zero_optimization"]["stage"] for i in (0, 1)]
    assert stages == [1, 3]


def test_status_detail_shows_the_engine_from_spec_json(tmp_path: Path) -> None:
    plan = builders.plan("tiny.yaml", "local", DEEPSPEED, "parallel.offload_optimizer=true")
    (tmp_path / "spec.json").write_text(run_dir_files(plan, "run.sh", "")[RunDir.SPEC].data.decode())  # type: ignore[union-attr]
    files = findings.read_files(str(tmp_path), with_env=True)
    found = findings.findings_from(files, 0.0)
    assert found.engine == "deepspeed ZeRO-2, optimizer offload" and found.steps == 60
    assert "engine: deepspeed ZeRO-2, optimizer offload" in detail_lines(_status(**found.status_fields()))
    assert findings.SPEC not in findings.read_files(str(tmp_path), with_env=False)  # the list view: not read
    assert (
        findings.parse_engine(json.dumps({"job": {"train": {}, "parallel": {"dp": 2, "dp_mode": "ddp"}}}))
        == "native (ddp)"
    )
    # tensor parallelism alone: no data parallelism, so no dp_mode to name
    assert (
        findings.parse_engine(json.dumps({"job": {"train": {}, "parallel": {"tp": 2, "dp_mode": "fsdp"}}})) == "native"
    )
    assert findings.parse_engine(json.dumps({"job": {"command": ["x"], "train": None}})) is None
    assert findings.parse_engine("{cut") is None
    garbled = {"job": {"train": {"engine": "deepspeed"}, "parallel": {"zero": "2"}}}
    assert findings.parse_engine(json.dumps(garbled)) is None


def test_the_slurm_round_trip_brings_spec_json_for_the_detail_view_only(tmp_path: Path) -> None:
    """findings_argv is the one remote command of a Slurm status: run here by a real sh."""
    from meshrun.submit.transport.base import LocalTransport

    run_dir = tmp_path / "it's a $(run)"
    run_dir.mkdir()
    plan = builders.plan("tiny.yaml", "local", DEEPSPEED, "parallel.zero=1")
    spec = run_dir_files(plan, "run.sh", "")[RunDir.SPEC].data
    (run_dir / "spec.json").write_bytes(spec)  # type: ignore[arg-type]
    marker = new_marker()
    for detail, engine in ((True, "deepspeed ZeRO-1"), (False, None)):
        done = LocalTransport().run(findings.findings_argv([str(run_dir)], detail, marker))
        (files,) = findings.split_findings(done.stdout, 1, marker)
        assert findings.findings_from(files, 0.0).engine == engine, (detail, sorted(files))


def test_the_local_backends_status_json_carries_the_engine(tmp_path: Path) -> None:
    from meshrun.submit.schedulers.local import BACKEND as LOCAL
    from meshrun.submit.transport.base import LocalTransport

    plan = builders.plan("tiny.yaml", "local", DEEPSPEED, "parallel.offload_optimizer=true")
    spec = run_dir_files(plan, "run.sh", "")[RunDir.SPEC].data
    (tmp_path / "spec.json").write_bytes(spec)  # type: ignore[arg-type]
    record = builders.record(
        "local-1", run_dir=tmp_path, scheduler="local", submitted_at=time.time() - 60, last_state="RUNNING"
    )
    (found,) = LOCAL.statuses([record], LocalTransport(), detail=True)
    assert json.loads(json.dumps(found.as_json()))["engine"] == "deepspeed ZeRO-2, optimizer offload"
    (listed,) = LOCAL.statuses([record], LocalTransport())
    assert listed.engine is None  # the list view does not read spec.json


@pytest.mark.parametrize(
    "zero, offload_optimizer, offload_params", [(0, False, False), (2, True, False), (3, True, True)]
)
def test_the_generated_config_with_accepted_overrides_parses_in_the_installed_deepspeed(
    zero: int, offload_optimizer: bool, offload_params: bool
) -> None:
    _deepspeed()
    from deepspeed.runtime.config import DeepSpeedConfig

    tuned = {"zero_optimization": {"reduce_bucket_size": 5.0e8, "stage3_prefetch_bucket_size": 1000}}
    job = _job(tuned, dp=1, zero=zero, offload_optimizer=offload_optimizer, offload_params=offload_params)
    parsed = DeepSpeedConfig(dsconfig.generate(job))  # world size 1 here: 16 = micro 4 x accumulation 4
    assert parsed.zero_optimization_stage == zero and parsed.gradient_accumulation_steps == 4
    assert parsed.zero_config.reduce_bucket_size == 500_000_000 and parsed.zero_config.prefetch_bucket_size == 1000
    assert (parsed.zero_config.offload_optimizer is not None) == offload_optimizer
    assert (parsed.zero_config.offload_param is not None) == offload_params
