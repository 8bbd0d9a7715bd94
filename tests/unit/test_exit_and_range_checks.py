"""README's exit codes and the range checks nothing else exercised: each through the real CLI.

Exit 1 is "the cluster failed" (here: its SSH port refuses the connection), exit 2 bad input:
memory above a node's, an odd head size, negative or non-finite optimizer settings. Each is one
line on stderr naming the key, the value and the fix.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from meshrun.submit.cli.main import main
from meshrun.submit.core.registry import Registry
from meshrun.submit.errors import InputError

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "examples" / "tiny.yaml")


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private HOME and XDG dirs: its own (empty) registry and no user profiles."""
    for var, sub in (("HOME", ""), ("XDG_STATE_HOME", "state"), ("XDG_CONFIG_HOME", "config")):
        monkeypatch.setenv(var, str(tmp_path / sub))
    return tmp_path


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().err


def unreachable_profile(tmp_path: Path) -> Path:
    """A Slurm cluster behind an SSH port nothing listens on (port 9: discard, closed here)."""
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text("")
    data = {
        "scheduler": "slurm",
        "ssh": {"host": "127.0.0.1", "port": 9, "user": "nobody", "known_hosts": str(known_hosts)},
        "paths": {"work_dir": str(tmp_path / "work")},
        "partitions": [{"name": "debug", "cpus_per_node": 4, "max_time": "1:00:00", "max_nodes": 2, "default": True}],
    }
    path = tmp_path / "unreachable.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_a_cluster_that_fails_exits_1_with_one_line_and_records_nothing(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile = unreachable_profile(home)
    code, err = run(capsys, "submit", str(REPO / "examples" / "command.yaml"), "-c", str(profile))
    assert code == 1, err
    assert err.startswith("meshrun: error: ") and err.count("\n") == 1, err
    assert "127.0.0.1:9" in err and "Traceback" not in err
    assert Registry().recent(10) == []  # nothing recorded for a job that never started


@pytest.mark.parametrize(
    "override, named, fix",
    [
        ("resources.memory_gb=3", "resources.memory_gb: 3", "a node of 'debug' has 2 GiB; ask for at most that"),
        ("train.model.d_model=132", "train.model.d_model: 132", "head size d_model/n_heads = 33 must be even"),
        ("train.grad_clip=-0.5", "train.grad_clip: -0.5", "must be at least 0 (0 turns clipping off; e.g. 1.0)"),
        ("train.weight_decay=-0.1", "train.weight_decay: -0.1", "must be at least 0 (0: no decay; e.g. 0.1)"),
        ("train.min_lr=-1e-5", "train.min_lr: -1e-05", "must be at least 0 (the cosine schedule's floor"),
        ("train.grad_clip=nan", "train.grad_clip: nan", "expected a finite number"),
        ("train.lr=inf", "train.lr: inf", "expected a finite number"),
        ("train.min_lr=-inf", "train.min_lr: -inf", "expected a finite number"),
        ("train.lr=1e400", "train.lr: inf", "expected a finite number"),  # float() overflows to inf
        ("resilience.health_timeout_s=5", "resilience.health_timeout_s: 5.0", "give 10 to 1800 seconds (default 120)"),
        ("resilience.min_free_gb=-1", "resilience.min_free_gb: -1.0", "give 0 (two checkpoints' worth) to 1000000 GB"),
        (
            "resilience.spare_nodes=2",
            "resilience.spare_nodes: 2",
            "1 node + 2 spares > the 2 nodes of partition 'debug'; ask for fewer, or a partition with room "
            "(resources.partition: wide (3 nodes))",
        ),
        (
            "resilience.spare_nodes=4",
            "resilience.spare_nodes: 4",
            "1 node + 4 spares > the 2 nodes of partition 'debug'; ",
        ),
        ("resilience.max_restarts=-1", "resilience.max_restarts: -1", "give 0 to 100 restarts (default 3)"),
        ("resilience.restart_on=failure,oom", "resilience.restart_on: 'oom'", "give some of failure, hang, health"),
        ("resilience.restart_on=failure,failure", "resilience.restart_on: 'failure'", "name each at most once"),
        ("resilience.spare_nodes=1 --set resilience.max_restarts=0", "resilience.spare_nodes: 1", "spares serve only"),
    ],
)
def test_bad_values_exit_2_with_key_value_and_fix(
    home: Path, capsys: pytest.CaptureFixture[str], override: str, named: str, fix: str
) -> None:
    sets = [word for one in override.split(" --set ") for word in ("--set", one)]  # one or more --set
    code, err = run(capsys, "render", TINY, "-c", "testbed", *sets)
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("meshrun: error: "), err
    assert f"{named}: {fix}" in err, err


@pytest.mark.parametrize(
    "override", ["resources.memory_gb=2", "train.model.d_model=136", "train.grad_clip=0", "train.weight_decay=0"]
)
def test_the_edges_are_allowed(home: Path, capsys: pytest.CaptureFixture[str], override: str) -> None:
    code, err = run(capsys, "render", TINY, "-c", "testbed", "--set", override)
    assert code == 0, err


def test_a_non_finite_number_in_the_file_is_refused_with_its_line(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = home / "job.yaml"
    spec.write_text(Path(TINY).read_text().replace("train:\n", "train:\n  grad_clip: .nan\n", 1))
    code, err = run(capsys, "render", str(spec), "-c", "testbed")
    assert code == 2 and "job.yaml:" in err and "train.grad_clip: nan: expected a finite number" in err, err


# ------------------------------------------------------------------ flags and outputs


@pytest.mark.parametrize(
    "argv, named",
    [
        (["submit", TINY, "-c", "local", "--json"], "--json without --dry-run: "),
        (["render", TINY, "-c", "local", "-o", "{tmp}"], "is a folder"),
        (["render", TINY, "-c", "local", "-o", "{tmp}/missing/job.sbatch"], "does not exist; create it first"),
        (["data", "--out", "{tmp}"], "--out: "),
    ],
    ids=["submit-json-alone", "render-o-folder", "render-o-missing-folder", "data-out-folder"],
)
def test_a_flag_that_cannot_be_honoured_is_one_line_exit_2_and_nothing_written(
    home: Path, capsys: pytest.CaptureFixture[str], argv: list[str], named: str
) -> None:
    folder = home / "out"
    folder.mkdir()
    code, err = run(capsys, *[arg.replace("{tmp}", str(folder)) for arg in argv])
    assert code == 2 and err.startswith("meshrun: error: ") and err.count("\n") == 1, err
    assert named in err, err
    assert list(folder.iterdir()) == [] and Registry().recent(10) == [], "nothing written, nothing submitted"


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from meshrun.submit import installed_version

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out == f"meshrun {installed_version()}\n"


def test_a_mistyped_verb_gets_the_nearest_one(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["sumbit", "examples/tiny.yaml"])
    said = capsys.readouterr().err.splitlines()
    err = said[-1]
    assert (
        done.value.code == 2
        and len(said) == 1  # one line, no usage block
        and err == "meshrun: error: no verb 'sumbit' (did you mean 'submit'?) (`meshrun --help` shows the usage)"
    )


def test_a_reader_that_goes_away_is_not_an_internal_error(tmp_path: Path) -> None:
    """`meshrun logs JOB --rank all | head -1`: the verb's output outlives its reader; exit 0, nothing on stderr."""
    flood = (
        "import sys; from meshrun.submit.cli import main as cli\n"
        "cli.VERBS['clusters'] = lambda args: [print('line ' * 20) for _ in range(200_000)] and 0\n"
        "sys.exit(cli.main(['clusters']))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "HOME": str(tmp_path)}
    verb = subprocess.Popen(
        [sys.executable, "-c", flood], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    assert verb.stdout is not None and verb.stdout.readline().startswith("line ")
    verb.stdout.close()  # what `head -1` does after its line
    _, err = verb.communicate(timeout=60)
    assert verb.returncode == 0 and err == "", err


@pytest.mark.parametrize(
    "argv, named",
    [
        (["status", "-n", "-5"], "-n/--limit: -5: give a number above 0"),
        (["submit", "", "-c", "local"], "argument spec: empty: give a job spec file"),
        (["export", "local-1", "--step", "-3", "-o", "x"], "--step: -3: give a number above 0"),
        (["export", "local-1", "--step", "two", "-o", "x"], "--step: 'two' is not a whole number"),
    ],
    ids=["status-n-negative", "submit-empty-spec", "export-step-negative", "export-step-word"],
)
def test_argument_values_argparse_refuses_by_name(
    home: Path, capsys: pytest.CaptureFixture[str], argv: list[str], named: str
) -> None:
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2 and named in capsys.readouterr().err


def test_export_of_a_step_that_is_not_complete_names_those_that_are() -> None:
    from meshrun.submit.errors import InputError
    from meshrun.submit.jobs.checkpoints import check_step

    check_step(4, [2, 4], "/ckpt")
    with pytest.raises(InputError, match=r"--step: 999: .* under /ckpt; complete steps: 2, 4"):
        check_step(999, [2, 4], "/ckpt")
    with pytest.raises(InputError, match="complete steps: none yet"):
        check_step(1, [], "/ckpt")


@pytest.mark.parametrize("steps, refused", [("100", True), ("60", True), ("101", False)])
def test_a_completed_job_resumes_only_to_train_further(steps: str, refused: bool) -> None:
    """README: resume of a COMPLETED job refuses train.steps not larger than done (it trained nothing)."""
    from meshrun.launcher.contract.spec.job import JobSpec, RunInfo, RunSpec, Train
    from meshrun.submit.errors import InputError
    from meshrun.submit.jobs.checkpoints import check_trains_further, with_overrides

    done = RunSpec(JobSpec(name="j", train=Train(steps=100)), RunInfo(cluster="c", scheduler="local", run_dir="/r"))
    again = with_overrides(done, [f"train.steps={steps}"])
    if refused:
        with pytest.raises(InputError, match=f"train.steps: {steps}: the job completed all 100 of its steps"):
            check_trains_further(done, again)
    else:
        check_trains_further(done, again)


@pytest.mark.parametrize("steps, newest, refused", [(100, 100, True), (100, 95, False), (120, 100, False)])
def test_a_stopped_job_whose_newest_checkpoint_is_its_last_step_is_not_resumed(
    tmp_path: Path, steps: int, newest: int, refused: bool
) -> None:
    """Found by a journey: orphaned ranks trained to the end and saved, the job was cancelled, and its resume
    ended COMPLETED having trained nothing."""
    from meshrun.launcher.contract.records import ckptdir
    from meshrun.launcher.contract.spec.job import JobSpec, RunInfo, RunSpec, Train
    from meshrun.submit.errors import InputError
    from meshrun.submit.jobs.checkpoints import check_steps_left
    from meshrun.submit.transport.base import LocalTransport

    (ckptdir.step_dir(tmp_path, newest) / ckptdir.MARKER).parent.mkdir(parents=True)
    (ckptdir.step_dir(tmp_path, newest) / ckptdir.MARKER).write_text("{}")
    spec = RunSpec(JobSpec(name="j", train=Train(steps=steps)), RunInfo(cluster="c", scheduler="local", run_dir="/r"))
    if refused:
        with pytest.raises(InputError, match=f"newest checkpoint is step {newest}: nothing is left to train"):
            check_steps_left(spec, str(tmp_path), LocalTransport())
    else:
        check_steps_left(spec, str(tmp_path), LocalTransport())


def test_an_example_profile_renders_offline(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """examples/h100-8node.yaml's own suggested command: its profile's login node does not exist."""
    spec = str(REPO / "examples" / "h100-8node.yaml")
    assert "-c h100-ndr --offline" in Path(spec).read_text()
    assert main(["render", spec, "-c", "h100-ndr", "--offline"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("#!/bin/bash") and "#SBATCH --nodes=8" in out.out, out.out[:300]
    assert out.err.startswith("# render --offline: the cluster was not asked"), out.err
    code, err = run(capsys, "render", spec, "-c", "h100-ndr", "--offline", "--upload")
    assert code == 2 and "--offline with --upload: " in err, err


@pytest.mark.parametrize(
    "argv, named",
    [
        (
            ["submit", TINY, "-c", "local", "--after", "local-1234", "--dry-run"],
            "--after: 'local-1234': dependencies are Slurm's; the local cluster has none",
        ),
        (
            ["submit", TINY, "-c", "local", "--sweep", "train.lr=0.1,0.2", "--dry-run"],
            "which the local cluster does not have; submit one job per value instead",
        ),
        (
            ["export", "local-1", "--max-shard-size", "1GB", "-o", "x.safetensors"],
            "--max-shard-size: '1GB': only --format hf is sharded",
        ),
    ],
    ids=["after-on-local", "sweep-on-local", "shard-size-without-hf"],
)
def test_what_a_cluster_or_format_does_not_have_is_said_plainly(
    home: Path, capsys: pytest.CaptureFixture[str], argv: list[str], named: str
) -> None:
    code, err = run(capsys, *argv)
    assert code == 2 and named in err, err


def test_render_of_an_unreachable_cluster_says_it_can_render_offline(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An example profile's host does not exist; render asks the cluster only for its home."""
    profile = unreachable_profile(home)
    code, err = run(capsys, "render", str(REPO / "examples" / "command.yaml"), "-c", str(profile))
    assert (
        code == 1
        and err.count("\n") == 1
        and err.rstrip().endswith("or render without asking the cluster: add --offline")
    ), err
    code, _ = run(capsys, "render", str(REPO / "examples" / "command.yaml"), "-c", str(profile), "--offline")
    assert code == 0
    # submit --dry-run asks the cluster too (a new user's trial tried it on h100-ndr): it names the offline way.
    code, err = run(capsys, "submit", str(REPO / "examples" / "command.yaml"), "-c", str(profile), "--dry-run")
    assert code == 1 and err.count("\n") == 1 and err.rstrip().endswith(f"-c {profile} --offline"), err


def test_spare_nodes_on_the_one_machine_local_cluster_are_refused(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = run(capsys, "render", TINY, "-c", "local", "--set", "resilience.spare_nodes=1")
    assert (
        code == 2
        and err == "meshrun: error: resilience.spare_nodes: 1: the local cluster is this one machine: give 0\n"
    )


def _numeric_fields(cls: type, path: str = "") -> list[tuple[str, Any]]:
    """(dotted key, dataclasses.Field) of every int or float field below a spec section, nested sections walked."""
    import dataclasses
    import typing

    found = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key, tp = f"{path}.{f.name}" if path else f.name, hints[f.name]
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        bare = args[0] if typing.get_origin(tp) is typing.Union and len(args) == 1 else tp
        if dataclasses.is_dataclass(bare) and isinstance(bare, type):
            found += _numeric_fields(bare, key)
        elif bare in (int, float):
            found.append((key, f))
    return found


UNBOUNDED = {
    "train.seed": "any integer seeds the generators",
    "train.model.n_kv_heads": "0 or a divisor of n_heads: a rule between two fields (Model.__post_init__)",
    "train.model.ffn_mult": "any positive multiple the layout search may pick; the planner sizes it",
    "train.eval_sequences": "at least train.global_batch: a rule between two fields (check_ranges)",
    "parallel.zero": "a DeepSpeed stage, checked with the deepspeed section (dsconfig)",
    "resources.memory_gb": "the scheduler's own unit, checked by Slurm's --test-only",
}
"""Numbers of a job spec without a declared range, each with the reason."""


def test_every_number_of_a_spec_has_its_range_declared_once_beside_it_and_its_default_within() -> None:
    """A bound is declared once, next to its field (`schema.bounded`), and the schema checks it as the spec is
    read, with the one-line error the planner gave before: no second list of ranges ~400 lines away."""
    from meshrun.launcher.contract.spec.job import JobSpec
    from meshrun.launcher.contract.spec.schema import BOUND

    fields = _numeric_fields(JobSpec)
    unbounded = {key for key, f in fields if BOUND not in f.metadata}
    assert unbounded == set(UNBOUNDED), f"declare these with schema.bounded: {sorted(unbounded - set(UNBOUNDED))}"
    for key, f in fields:
        if BOUND in f.metadata and f.default is not None:
            assert f.metadata[BOUND].holds(f.default), f"{key}'s default {f.default} is outside its own range"


@pytest.mark.parametrize(
    "key, value, shown, message",
    [
        ("sidecar.interval_s", "0", "0.0", "give 0.1 to 3600 seconds (default 5)"),
        ("resilience.max_restarts", "101", "101", "give 0 to 100 restarts (default 3)"),
        ("alerts.loss_spike_factor", "1", "1.0", "give a factor above 1 (e.g. 3), or 0 to turn the rule off"),
        ("train.lr", "0", "0.0", "the learning rate must be positive, e.g. 3e-4"),
        (
            "checkpoint.keep",
            "0",
            "0",
            "keep at least 1 complete checkpoint (the one a requeued job resumes from), e.g. 3",
        ),
    ],
)
def test_a_declared_bound_refuses_in_a_file_and_in_set_with_one_line(
    tmp_path: Path, key: str, value: str, shown: str, message: str
) -> None:
    from meshrun.submit.planning.plan import load_job

    section, leaf = key.split(".")
    spec = tmp_path / "job.yaml"
    spec.write_text(f"name: x\n{'' if section == 'train' else 'train: {}'}\n{section}:\n  {leaf}: {value}\n")
    with pytest.raises(InputError) as info:
        load_job(spec)
    assert str(info.value) == f"{spec}:4: {key}: {shown}: {message}"
    with pytest.raises(InputError) as info:
        load_job(REPO / "examples" / "tiny.yaml", [f"{key}={value}"])
    assert str(info.value) == f"--set {key}: {shown}: {message}"
    # 0 turns a rule off where the bound says so
    assert load_job(REPO / "examples" / "tiny.yaml", ["alerts.loss_spike_factor=0"])[0].alerts.loss_spike_factor == 0
