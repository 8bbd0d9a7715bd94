"""Every validation error names the key, the value and the fix, before anything touches a cluster."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshrun.launcher.contract.spec.parallel_dims import ParallelDims
from meshrun.submit.config.cluster import load_profile
from meshrun.submit.core.plan import format_time, parse_time
from meshrun.submit.errors import InputError
from meshrun.submit.planning.plan import describe, load_job, plan_file
from tests.helpers import builders

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "tiny.yaml"
BIG = REPO / "examples" / "h100-8node.yaml"
TWO = REPO / "examples" / "two-node.yaml"
GPT3D = REPO / "examples" / "gpt-3d.yaml"


@pytest.mark.parametrize(
    "cluster, spec, overrides, key, message",
    [
        ("local", TINY, ["parallel.dp=3"], "parallel", r"dp\(3\)\*tp\(1\)\*pp\(1\)=3 != world size 2"),
        ("h100-ndr", BIG, ["parallel.tp=16", "parallel.dp=4"], "parallel.tp", "one NVLink/NVSwitch domain of 8"),
        (
            "h100-ndr",
            BIG,
            ["parallel.pp=5", "parallel.dp=4", "parallel.tp=4", "resources.nodes=10"],
            "parallel.pp",
            r"pp\(5\) must divide train.model.n_layers\(24\)",
        ),
        (
            "h100-ndr",
            BIG,
            ["train.model.n_heads=12", "train.model.d_model=1536", "parallel.tp=8", "parallel.dp=8"],
            "parallel.tp",
            r"n_heads\(12\) must be divisible by tp\(8\)",
        ),
        ("h100-ndr", BIG, ["resources.time=3-00:00:00"], "resources.time", "at most 2-00:00:00"),
        ("h100-ndr", BIG, ["resources.partition=gpus"], "resources.partition", "did you mean 'gpu'"),
        ("h100-ndr", BIG, ["resources.gpus_per_node=16"], "resources.gpus_per_node", "has 8 GPUs"),
        ("h100-ndr", BIG, ["resources.nodes=65", "parallel.dp=130"], "resources.nodes", "at most 64 nodes"),
        ("h100-ndr", BIG, ["train.global_batch=500"], "train.global_batch", r"micro_batch\(4\)\*dp\(16\)=64"),
        ("local", TINY, ["train.model.d_model=130"], "train.model.d_model", r"130 % 4 = 2"),
        ("local", TINY, ["resources.nodes=2"], "resources.nodes", "one machine"),
        ("local", TINY, ["train.precision=bf16"], "train.precision", "CPU ranks train in fp32"),
        ("local", TINY, ["train.steps=0"], "train.steps", "at least 1"),
        ("local", TINY, ["train.lr=-1"], "train.lr", "must be positive"),
        ("local", TINY, ["resources.time=soon"], "resources.time", "Slurm's time syntax"),
        ("local", TINY, ["data.val_fraction=1.5"], "data.val_fraction", r"\[0, 1\)"),
        (
            "testbed",
            TINY,
            ["resources.tasks_per_node=3", "resources.gpus_per_node=2"],
            "resources.tasks_per_node",
            "one rank per GPU",
        ),
        ("testbed", TINY, ["resources.cpus_per_task=3"], "resources.cpus_per_task", r"=6 > 4 CPUs"),
        # 3D layouts: what the ranks would find only after start-up (or by hanging) is caught here.
        (
            "testbed",
            TWO,
            ["parallel.dp=2", "parallel.tp=2", "train.model.vocab_size=255"],
            "parallel.tp",
            r"vocab_size\(255\) must be divisible by tp\(2\).*255 % 2 = 1",
        ),
        (
            "local",
            GPT3D,
            ["parallel.sequence_parallel=true", "train.model.seq_len=127"],
            "parallel.sequence_parallel",
            r"seq_len\(127\) over tp\(2\): 127 % 2 = 1; pick a seq_len divisible by tp or set sequence_parallel: false",
        ),
        (
            "testbed",
            TWO,
            ["parallel.dp=1", "parallel.tp=4"],
            "parallel.tp",
            r"tp\(4\) must divide the 2 ranks per node",
        ),
        (
            "local",
            GPT3D,
            ["train.global_batch=4"],
            "train.global_batch",
            r"gives 1 micro-batch\(es\) per step .* fewer than the pp\(2\) pipeline stages",
        ),
        ("local", GPT3D, ["parallel.pp_schedule=zb"], "parallel.pp_schedule", "must be one of 1f1b, gpipe"),
        # Model options: grouped-query attention splits whole kv heads over tp; a tied head needs one stage.
        ("local", TINY, ["train.model.n_kv_heads=3"], "train.model.n_kv_heads", r"give a divisor of n_heads \(4\)"),
        (
            "local",
            GPT3D,
            ["train.model.n_kv_heads=1"],
            "parallel.tp",
            r"n_kv_heads\(1\) must be divisible by tp\(2\).*1 % 2 = 1; use a tp that divides 1",
        ),
        (
            "local",
            GPT3D,
            ["train.model.tie_embeddings=true"],
            "parallel.pp",
            "tie_embeddings shares one matrix .*; use pp 1 or set train.model.tie_embeddings: false",
        ),
        # Validation runs whole global batches.
        (
            "local",
            TINY,
            ["train.eval_sequences=8"],
            "train.eval_sequences",
            r"at least train.global_batch \(16\) sequences; set eval_sequences >= 16 or train.eval_every: 0",
        ),
        # Checkpoint policy.
        ("local", TINY, ["checkpoint.keep=0"], "checkpoint.keep", "keep at least 1 complete checkpoint"),
        ("local", TINY, ["checkpoint.every=-5"], "checkpoint.every", "must be at least 0"),
        ("local", TINY, ["checkpoint.keep_every=-1"], "checkpoint.keep_every", r"must be at least 0 \(0 keeps nothing"),
        ("local", TINY, ["checkpoint.max_requeues=-1"], "checkpoint.max_requeues", r"must be at least 0 \(0 never"),
        ("local", TINY, ["checkpoint.resume_step=0"], "checkpoint.resume_step", "give a step >= 1, or null"),
        # GPU jobs: one rank per GPU, however the counts are given.
        (
            "h100-ndr",
            BIG,
            ["resources.tasks_per_node=4"],
            "resources.tasks_per_node",
            r"one rank per GPU: set it to resources.gpus_per_node \(8\)",
        ),
    ],
)
def test_errors_name_key_value_and_fix(cluster, spec, overrides, key, message) -> None:
    with pytest.raises(InputError, match=message) as info:
        builders.plan(spec, cluster, *overrides, checked=True)
    assert info.value.key.endswith(key)
    assert info.value.fix


@pytest.mark.parametrize(
    "cluster, spec, overrides",
    [
        ("local", TINY, ["train.eval_every=0", "train.eval_sequences=1"]),  # no validation: any count
        ("local", TINY, ["train.eval_sequences=16"]),  # exactly one global batch
        ("local", GPT3D, ["parallel.sequence_parallel=true"]),  # seq_len 128 % tp 2 = 0
        ("local", GPT3D, ["train.model.seq_len=127"]),  # odd seq_len: fine without sp
        (
            "local",
            GPT3D,
            [
                "parallel.tp=1",
                "parallel.dp=4",
                "parallel.sequence_parallel=true",
                "train.model.seq_len=127",
                "train.model.vocab_size=255",
            ],
        ),  # tp 1 splits nothing
        ("local", TINY, ["checkpoint.keep_every=0", "checkpoint.max_requeues=0", "checkpoint.resume_step=1"]),
        ("local", TINY, ["checkpoint.resume_step=null"]),
        ("local", GPT3D, ["train.model.n_kv_heads=2", "train.model.rope_theta=500000"]),  # 2 kv heads over tp 2
        ("local", GPT3D, ["train.model.tie_embeddings=true", "parallel.pp=1", "parallel.dp=4"]),  # tied under tp 2
    ],
)
def test_edges_that_are_allowed(cluster, spec, overrides) -> None:
    builders.plan(spec, cluster, *overrides, checked=True)


def test_error_line_carries_key_value_and_fix() -> None:
    with pytest.raises(InputError) as info:
        builders.plan(TWO, "testbed", "parallel.dp=2", "parallel.tp=2", "train.model.vocab_size=50257", checked=True)
    text = str(info.value)
    assert text.startswith("parallel.tp: 2: train.model.vocab_size(50257) must be divisible by tp(2)"), text
    assert "\n" not in text


def test_describe_shows_the_3d_layout() -> None:
    shown = describe(builders.plan(GPT3D, "local", checked=True))
    assert {k: shown[k] for k in ("dp", "tp", "pp", "dp_mode", "accumulation", "pp_schedule", "sequence_parallel")} == {
        "dp": 2,
        "tp": 2,
        "pp": 2,
        "dp_mode": "fsdp",
        "accumulation": 4,
        "pp_schedule": "1f1b",
        "sequence_parallel": False,
    }
    assert (
        describe(
            builders.plan(GPT3D, "local", "parallel.pp_schedule=gpipe", "parallel.sequence_parallel=true", checked=True)
        )["pp_schedule"]
        == "gpipe"
    )
    flat = describe(builders.plan(TINY, "local", checked=True))  # dp only: nothing about pipelines or tp
    assert flat["accumulation"] == 2 and "pp_schedule" not in flat and "sequence_parallel" not in flat
    assert "dp" not in describe(builders.plan(REPO / "examples" / "command.yaml", "local", checked=True))


def test_gpt_3d_example_is_the_8_rank_3d_layout() -> None:
    plan = builders.plan(GPT3D, "local", checked=True)
    spec = plan.spec
    assert spec.world_size == 8 and (spec.parallel.pp, spec.parallel.dp, spec.parallel.tp) == (2, 2, 2)
    t = spec.trainer
    accumulation = t.global_batch // (t.micro_batch * spec.parallel.dp)
    assert accumulation >= spec.parallel.pp  # every pipeline stage gets micro-batches to overlap
    assert t.eval_every and t.eval_sequences >= t.global_batch and spec.checkpoint.every


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.stepz=3", r"unknown key \(did you mean 'steps'\?\)"),
        ("train.steps=many", "expected a whole number"),
        ("train.activation_checkpointing=maybe", "expected true or false"),
        ("train.precision=fp8", "must be one of fp32, bf16, fp16"),
        ("train.model=big", "this key is a section"),
        ("train.steps.x=1", "has no sub-keys"),
        ("noequals", "KEY=VALUE"),
    ],
)
def test_set_overrides_are_checked(override: str, message: str) -> None:
    with pytest.raises(InputError, match=message):
        builders.plan(TINY, "local", override, checked=True)


def test_set_casts_to_the_field_type() -> None:
    spec, submitted = load_job(
        TINY,
        [
            "train.steps=7",
            "train.lr=0.01",
            "train.activation_checkpointing=true",
            "resources.partition=local",
            "env.FOO=1",
            "command=python,x.py",
            "train=null",
        ],
    )
    assert spec.trainer.steps == 60 or spec.train is None  # train cleared, command set
    assert spec.command == ("python", "x.py") and spec.env["FOO"] == "1"
    # A list also takes YAML's flow form, as written in a spec file (no "[python" argv word).
    spec, _ = load_job(TINY, ["command=[python, x.py, --lr, 0.1]", "train=null"])
    assert spec.command == ("python", "x.py", "--lr", "0.1")
    # ... read as YAML reads it: a quoted item keeps its commas and loses its quotes; yes and 1 stay text.
    spec, _ = load_job(TINY, ['command=[python3, -c, "print(1, 2)", yes, 1]', "train=null"])
    assert spec.command == ("python3", "-c", "print(1, 2)", "yes", "1")
    with pytest.raises(InputError, match=r"command: .*not a YAML list; write it in flow form"):
        load_job(TINY, ['command=[python3, "unclosed]', "train=null"])
    with pytest.raises(InputError, match=r"command: .*expected a list of plain values"):
        load_job(TINY, ["command=[python3, [nested]]", "train=null"])
    spec, _ = load_job(TINY, ["train.steps=7", "train.lr=0.01", "train.activation_checkpointing=true"])
    assert (spec.trainer.steps, spec.trainer.lr, spec.trainer.activation_checkpointing) == (7, 0.01, True)


def test_unknown_key_in_file_points_at_its_line(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("name: x\nresources:\n  nodes: 1\n  tasks_per_nod: 2\n")
    with pytest.raises(InputError) as info:
        load_job(path)
    assert str(info.value).startswith(
        f"{path}:4: resources.tasks_per_nod: 2: unknown key (did you mean 'tasks_per_node'?)"
    )


def test_a_renamed_key_is_refused_with_its_new_name_in_a_file_and_in_set(tmp_path: Path) -> None:
    """checkpoint.max_restarts (requeues of the job) shared its name with resilience.max_restarts (restarts inside
    one allocation); it is checkpoint.max_requeues now, and the old key says so wherever it is written."""
    path = tmp_path / "job.yaml"
    path.write_text("name: x\ncheckpoint:\n  max_restarts: 5\n")
    with pytest.raises(InputError) as info:
        load_job(path)
    assert str(info.value) == f"{path}:3: checkpoint.max_restarts: 5: renamed: write checkpoint.max_requeues instead"
    with pytest.raises(InputError) as info:
        load_job(TINY, ["checkpoint.max_restarts=5"])
    assert str(info.value) == "--set checkpoint.max_restarts: '5': renamed: write checkpoint.max_requeues instead"
    assert load_job(TINY, ["checkpoint.max_requeues=5"])[0].checkpoint.max_requeues == 5
    assert load_job(TINY, ["resilience.max_restarts=2"])[0].resilience.max_restarts == 2  # the other count


@pytest.mark.parametrize(
    "text, line", [("name: x\nresources: [\n  nodes: 1\n", 4), ("name: x\n  bad: 1\n", 2), ("name: x\nname: y\n", 2)]
)
def test_bad_yaml_is_one_line_with_file_and_line(tmp_path: Path, text: str, line: int) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    with pytest.raises(InputError) as info:
        load_job(path)
    assert str(info.value).startswith(f"{path}:{line}:") and "\n" not in str(info.value)


def test_train_and_command_are_exclusive(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("name: x\ntrain: {steps: 1}\ncommand: [python, a.py]\n")
    with pytest.raises(InputError, match="either `train` or `command`"):
        load_job(path)


def test_missing_spec_file() -> None:
    with pytest.raises(InputError, match="cannot read"):
        load_job(Path("/nonexistent/job.yaml"))


@pytest.mark.parametrize(
    "text, seconds",
    [("30", 1800), ("1:30", 90), ("01:00:00", 3600), ("2-00", 172800), ("1-02:03", 93780), ("1-02:03:04", 93784)],
)
def test_slurm_time_syntax(text: str, seconds: int) -> None:
    assert parse_time(text) == seconds
    assert parse_time(format_time(seconds)) == seconds


def test_parallel_dims_message_carries_the_arithmetic() -> None:
    with pytest.raises(ValueError, match=r"dp\(2\)\*tp\(4\)\*pp\(2\)=16 != world size 8"):
        ParallelDims(2, 4, 2).validate(world_size=8, n_layers=4, n_heads=4, ranks_per_node=8)


def test_plan_resolves_home_and_checkpoint_root() -> None:
    plan = plan_file(TINY, load_profile("local"), home="/home/u")
    assert plan.run_dir.startswith("/home/u/.local/share/meshrun/runs/tiny-gpt-")
    assert plan.run_spec.run.checkpoint_dir == f"{plan.run_dir}/checkpoints"
    big = builders.plan(BIG, "h100-ndr", checked=True)
    assert big.run_spec.run.checkpoint_dir == "/lustre/alice/checkpoints/r"
    assert big.run_spec.run.nccl_env["NCCL_IB_HCA"].startswith("=mlx5_0")


def test_hostile_name_gives_a_safe_run_dir() -> None:
    plan = plan_file(TINY, load_profile("local"), ["name=$(rm -rf ~) x/../y"], home="/home/u")
    leaf = plan.run_dir.rsplit("/", 1)[1]
    assert "/" not in leaf and "$" not in leaf and " " not in leaf and ".." not in plan.run_dir


def test_the_scheduler_checks_are_handed_in_and_api_hands_in_the_backends() -> None:
    """Planning never looks a scheduler up: it runs the check its caller gives (api.plan_job: the backend's)."""
    from meshrun.submit import api

    seen: list[tuple[str, str]] = []
    profile = load_profile("local")
    plan_file(TINY, profile, home="/home/u", run_dir="/r", scheduler_check=lambda s, p: seen.append((s.name, p.name)))
    assert seen == [(load_job(TINY)[0].name, "local")]
    with pytest.raises(InputError, match="one machine") as info:
        api.plan_job(TINY, profile, ["resources.nodes=2"], home="/home/u")
    assert info.value.key == "resources.nodes"


@pytest.mark.parametrize(
    "override, message",
    [
        ("name=", "--set name: '': give the job a name"),
        ("train.steps=-1", "--set train.steps: -1: must be at least 1"),
        ("train.optim.lr=0.1", "--set train.optim.lr=0.1: 'optim': unknown key; lr is train.lr; valid keys:"),
        # a key written a level too high is told where it lives, not the nearest spelling ('model' -> 'code')
        ("model.d_model=64", "--set model.d_model=64: 'model': unknown key; model is train.model; valid keys:"),
        ("lr=0.1", "--set lr=0.1: 'lr': unknown key; lr is train.lr; valid keys:"),
        ("train.stesp=3", "--set train.stesp=3: 'stesp': unknown key (did you mean 'steps'?); valid keys:"),
    ],
)
def test_an_error_in_an_override_names_the_override_not_a_line_of_the_file(override: str, message: str) -> None:
    with pytest.raises(InputError) as info:
        load_job(TINY, [override])
    assert str(info.value).startswith(message), str(info.value)


def test_a_command_over_a_training_spec_is_told_how_to_drop_the_training() -> None:
    """A new user's trial: `--set 'command=[...]'` on examples/tiny.yaml said "not both" and no way out."""
    with pytest.raises(InputError, match=r"not both: drop the spec's `train:` section \(or `--set train=null`\)"):
        load_job(TINY, ['command=[python3, -c, "print(1, 2)"]'])
    spec, _ = load_job(TINY, ['command=[python3, -c, "print(1, 2)"]', "train=null"])
    assert spec.command == ("python3", "-c", "print(1, 2)") and spec.train is None


def test_a_section_written_a_level_too_high_in_the_file_is_told_where_it_lives(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("name: x\nmodel:\n  d_model: 64\n")
    with pytest.raises(InputError, match=rf"^{path}:2: model: .*: unknown key; model is train.model; valid keys: "):
        load_job(path)


def test_an_error_in_the_file_still_names_its_line(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("name: x\ntrain:\n  steps: -1\n")
    with pytest.raises(InputError, match=rf"^{path}:3: train.steps: -1: must be at least 1"):
        load_job(path, ["train.lr=0.01"])


@pytest.mark.parametrize(
    "given, meant",
    [("llama-80b", "llama-70b"), ("llama-6b", "llama-7b"), ("llama3-7b", "llama3-8b"), ("lama-7b", "llama-7b")],
)
def test_a_preset_off_by_its_size_gets_the_nearest_size_not_the_nearest_spelling(given: str, meant: str) -> None:
    """'llama-80b' suggested 'llama3-8b'."""
    from meshrun.launcher.contract.spec.presets import PRESETS
    from meshrun.launcher.contract.spec.schema import closest

    assert closest(given, PRESETS) == f" (did you mean {meant!r}?)"


def test_type_errors_speak_yaml_and_a_scalar_list_says_how_to_write_it(tmp_path: Path) -> None:
    """Errors printed Python's True/None for what the user wrote as true/null, and
    `restart_on: failure` (refused in a file, read as [failure] by --set) said only "expected a list"."""
    spec = tmp_path / "job.yaml"
    spec.write_text("name: x\nresources: {nodes: true}\n")
    with pytest.raises(InputError) as bad:
        load_job(spec)
    assert "resources.nodes: true:" in str(bad.value) and "True" not in str(bad.value)
    spec.write_text("name: x\nresilience: {restart_on: failure}\n")
    with pytest.raises(InputError, match=r"resilience.restart_on: 'failure': expected a list: write \[failure\]"):
        load_job(spec)
    spec.write_text("name: x\n")
    job, _ = load_job(spec, ["resilience.restart_on=failure"])
    assert job.resilience.restart_on == ("failure",)


def test_a_run_dir_written_before_the_rename_still_runs(tmp_path: Path) -> None:
    """meshrun's own records are read with the new name (a requeued start, a resume of an older run dir); only a
    person's input is refused with the pointer."""
    import json

    from meshrun.launcher.contract.spec.job import dumps_run_spec, loads_run_spec
    from meshrun.submit.config.cluster import load_profile

    run_spec = builders.plan("tiny.yaml", load_profile("local")).run_spec
    old = json.loads(dumps_run_spec(run_spec))
    old["job"]["checkpoint"]["max_restarts"] = old["job"]["checkpoint"].pop("max_requeues")
    old["job"]["checkpoint"]["max_restarts"] = 7
    assert loads_run_spec(json.dumps(old), "spec.json").job.checkpoint.max_requeues == 7
