"""The preflight's checks (submit/schedulers/preflight.py), run for real through this machine's shell (the files,
the space, the interpreter after setup lines), and its reading of Slurm's recorded `sbatch --test-only` answers.
The same checks against the real Slurm testbed: tests/integration/test_preflight.py."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import pytest

from meshrun.launcher import __version__
from meshrun.submit.core.plan import Plan
from meshrun.submit.schedulers import preflight
from meshrun.submit.schedulers.base import Request
from meshrun.submit.transport.base import LocalTransport, Result
from tests.helpers import builders

REPO = Path(__file__).resolve().parents[2]


def _plan(tmp_path: Path, *overrides: str, profile: str = "local") -> Plan:
    corpus = tmp_path / "tokens.u16"
    corpus.write_bytes(b"\0" * 16384)  # 8192 tokens: 60 sequences of tiny.yaml's 129
    return builders.plan("tiny.yaml", profile, f"data.path={corpus}", *overrides, home=str(tmp_path), run_dir=None)


def _request(scheduler: str = "local") -> Request:
    return Request(scheduler=scheduler, run_dir="/x", script_path="/x/run.sh", script="#!/bin/sh\n", argv=("true",))


def _run(plan: Plan, local: bool = True) -> preflight.Preflight:
    return preflight.run(plan, _request(), LocalTransport(), local)


def test_a_job_whose_files_are_there_passes(tmp_path: Path) -> None:
    checked = _run(_plan(tmp_path))
    assert [c.what for c in checked.checks] == ["files", "space"] and not checked.failures, checked


def test_a_missing_data_file_and_init_weights_are_named_with_the_key(tmp_path: Path) -> None:
    plan = _plan(tmp_path, "train.init_from=~/no/weights.safetensors", "data.val_path=/no/val.u16")
    (check,) = _run(plan).failures
    assert check.what == "files"
    home = os.path.expanduser("~")  # `~/` is the cluster user's home, expanded there (here: this user's)
    assert f"train.init_from: {home}/no/weights.safetensors is not on the cluster" in check.line
    assert "data.val_path: /no/val.u16 is not on the cluster" in check.line and "data.path" not in check.line


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (
            b'{"text": "a document"}\n' * 300,
            "is text, not token ids; name it .txt, .md or .jsonl",
        ),
        (b'{"text": "short"}\n' * 4, "is text, not token ids"),
        (b"\0" * 4095, "4095 bytes is not a whole number of uint16 tokens (cut short, or not a token file)"),
        (
            b"".join(i.to_bytes(2, "little") for i in (5, 300, 7, 0)),
            "token id 300 (in its first MiB) is not below train.model.vocab_size=256; raise",
        ),
    ],
)
def test_a_data_file_on_the_cluster_that_is_not_token_ids_is_refused(tmp_path: Path, content: bytes, said: str) -> None:
    """The data file as the cluster sees it (sh, od and awk on the login node: the laptop may not see it), judged
    as the submit judges one it sees (meshrun.launcher.contract.spec.tokens.sample_problem); not read again where it did."""
    plan = _plan(tmp_path)
    Path(plan.spec.data.path).write_bytes(content)
    (check,) = _run(plan).failures
    assert check.what == "files" and check.line.startswith(f"data.path: {plan.spec.data.path} "), check.line
    assert said in check.line, check.line
    assert not preflight.run(plan, _request(), LocalTransport(), True, inspect_data=False).failures


def test_a_secret_file_others_can_read_is_refused_and_its_content_never_read(tmp_path: Path) -> None:
    secret = tmp_path / "token"
    secret.write_text("hunter2\n")
    secret.chmod(0o644)
    plan = _plan(tmp_path)
    job = dataclasses.replace(plan.spec, secrets={"HF_TOKEN": {"file": str(secret)}})
    checked = _run(dataclasses.replace(plan, spec=job))
    (check,) = checked.failures
    assert check.line == f"secrets.HF_TOKEN: {secret} is readable by others on the cluster; chmod 600 it"
    assert "hunter2" not in repr(checked)
    secret.chmod(0o600)
    assert not _run(dataclasses.replace(plan, spec=job)).failures


def test_paths_with_shell_words_are_data_not_code(tmp_path: Path, canary: Path) -> None:
    hostile = f"/tmp/$(touch {canary})`touch {canary}`; touch {canary}"
    (check,) = _run(_plan(tmp_path, f"data.val_path={hostile}")).failures
    assert hostile in check.line and not canary.exists()


def test_too_little_space_names_the_root_the_need_and_the_fixes(tmp_path: Path) -> None:
    plan = _plan(tmp_path, "resilience.min_free_gb=1000000")
    (check,) = _run(plan).failures
    assert check.what == "space" and "1000000.0 GB needed (resilience.min_free_gb); " in check.line, check.line
    assert check.line.endswith("or lower it") and check.line.startswith(plan.run_spec.run.checkpoint_dir + ": ")
    # without min_free_gb the need is the model's two checkpoints (the planner's size): a spec that sets nothing
    defaults = dataclasses.replace(
        plan, spec=dataclasses.replace(plan.spec, resilience=dataclasses.replace(plan.spec.resilience, min_free_gb=0))
    )
    assert "for two checkpoints; " in preflight._space_reason(defaults)


def test_the_environment_runs_the_setup_lines_then_the_interpreter(tmp_path: Path) -> None:
    plan = _plan(tmp_path)
    cluster = dataclasses.replace(plan.cluster, python=sys.executable, setup=("false", "export X=1"))
    checked = _run(dataclasses.replace(plan, cluster=cluster), local=False)
    env = next(c for c in checked.checks if c.what == "environment")
    assert env.ok and env.line.startswith("torch ") and "setup[0] (false) failed" in env.line, env
    broken = dataclasses.replace(cluster, python="/nonexistent/python3")
    env = next(
        c for c in _run(dataclasses.replace(plan, cluster=broken), local=False).checks if c.what == "environment"
    )
    assert not env.ok and "`/nonexistent/python3` after the profile's setup lines" in env.line, env
    assert "fix `setup:` or `python:` in the cluster profile" in env.line


def _env_answer(plan: Plan, stdout: str, code: int = 0) -> preflight.Check:
    return preflight._environment(plan, Result(("bash",), code, stdout, ""))


def test_an_interpreter_without_torch_or_with_another_meshrun_fails(tmp_path: Path) -> None:
    plan = _plan(tmp_path)
    assert "cannot import torch" in _env_answer(plan, "torch -\nmeshrun -\n").line
    other = _env_answer(plan, "torch 2.5.0\nmeshrun 0.0.1\n")
    assert not other.ok and f"the cluster's meshrun is 0.0.1, this one is {__version__}" in other.line
    assert _env_answer(plan, "torch 2.5.0\nmeshrun -\n").line == "torch 2.5.0, meshrun from the code snapshot"
    command = dataclasses.replace(plan, spec=dataclasses.replace(plan.spec, command=("python", "x.py"), train=None))
    assert _env_answer(command, "torch -\nmeshrun -\n").ok  # a command job may not need torch


@pytest.mark.parametrize("local", [True, False])
def test_a_command_not_on_path_fails_the_check_before_it_queues(
    tmp_path: Path, local: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new user's trial: `command: [no-such-program-xyz]` passed the check, queued, started twice and gave up. The
    program is looked up on PATH where the ranks will (after the profile's setup lines on a cluster)."""
    plan = _plan(tmp_path)
    cluster = dataclasses.replace(plan.cluster, python=sys.executable, setup=("export PATH=/nowhere:$PATH",))

    def checked(*command: str) -> list[preflight.Check]:
        spec = dataclasses.replace(plan.spec, command=command, train=None)
        return list(_run(dataclasses.replace(plan, spec=spec, cluster=cluster), local=local).checks)

    failed = [c for c in checked("no-such-program-xyz", "--flag") if not c.ok]
    assert len(failed) == 1 and failed[0].what == "program", failed  # one label, local or not
    assert failed[0].line.startswith("command: `no-such-program-xyz` is not on PATH "), failed
    assert "give an absolute path, install it, or load it in the profile's `setup:` lines" in failed[0].line
    found = checked("sh", "-c", "true")
    assert all(c.ok for c in found) and [c.line for c in found if c.what == "program"] == ["`sh` is on PATH"], found
    assert all(c.ok for c in checked("./relative/script.sh")), "a path is uploaded with the code: not judged here"
    monkeypatch.chdir(tmp_path)  # where an injected `touch` would write
    named = checked("$(touch pwned)")  # a name is data, never code
    assert not (tmp_path / "pwned").exists() and not all(c.ok for c in named)


# Recorded from the testbed's Slurm 22.05 (tests/integration/test_preflight.py asks the real one).
ACCEPTED = "sbatch: Job 2470 to start at 2026-12-03T22:12:28 using 2 processors on nodes n[1-2] in partition debug\n"
BAD_PARTITION = (
    "sbatch: error: invalid partition specified: ghost\nallocation failure: Invalid partition name specified\n"
)
TOO_MANY = "allocation failure: Requested node configuration is not available\n"


@pytest.mark.parametrize(
    ("code", "said", "ok", "line"),
    [
        (0, ACCEPTED, True, "Slurm can run it: on n[1-2] in debug, estimated start 2026-12-03T22:12:28"),
        (1, BAD_PARTITION, False, "Slurm refuses the request: Invalid partition name specified; check resources"),
        (1, TOO_MANY, False, "Slurm refuses the request: Requested node configuration is not available; check"),
        (127, "sh: 1: sbatch: not found\n", False, "Slurm refuses the request: sh: 1: sbatch: not found"),
    ],
)
def test_slurms_answer_is_read(code: int, said: str, ok: bool, line: str) -> None:
    check, start = preflight._slurm(Result(("sh",), code, said, ""))
    assert check.ok == ok and check.line.startswith(line), check
    assert start == ("2026-12-03T22:12:28" if ok else None)


def test_a_sweep_over_max_array_size_names_the_limit_and_the_count() -> None:
    """1,002 tasks where MaxArraySize is 1,001 got Slurm's 'Invalid job array specification' and a
    hint to check nodes, partition and time. The sweep's test asks for the limit when Slurm refuses."""
    said = "sbatch: error: Batch job submission failed: Invalid job array specification\nMaxArraySize = 1001\n"
    check, _ = preflight._slurm(Result(("sh",), 1, said, ""), tasks=1002)
    assert not check.ok and "its 1002 tasks are more than the cluster's MaxArraySize=1001" in check.line, check
    assert "at most 1001 tasks, indexes 0-1000" in check.line and "split the sweep" in check.line
    check, _ = preflight._slurm(Result(("sh",), 1, said, ""), tasks=10)  # refused for another reason
    assert check.line.startswith("Slurm refuses the request: Batch job submission failed: Invalid job array"), check
    assert "MaxArraySize" not in check.line
    assert "scontrol show config" in preflight.TEST_ARRAY and "exit $s" in preflight.TEST_ARRAY


def test_slurm_gets_the_rendered_script_on_its_input_and_no_job_is_queued(tmp_path: Path) -> None:
    plan = _plan(tmp_path, profile="testbed")
    (argv,) = [argv for what, argv in preflight.commands(plan, _request("slurm"), local=False) if what == "slurm"]
    assert argv[:3] == ["sh", "-c", preflight.TEST_ONLY] and argv[4] == "#!/bin/sh\n"
    assert "--test-only" in preflight.TEST_ONLY and f"--chdir={plan.run_dir}" in argv


def test_the_clusters_a_submit_chooses_among(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from meshrun.submit import api
    from meshrun.submit.errors import InputError

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    assert api.clusters_asked("testbed") is None and api.clusters_asked("a, b") == ["a", "b"]
    with pytest.raises(InputError, match="you have no cluster profiles yet"):
        api.clusters_asked("any")
    (tmp_path / "meshrun" / "clusters").mkdir(parents=True)
    for name in ("zeta", "alpha"):
        (tmp_path / "meshrun" / "clusters" / f"{name}.yaml").write_text("scheduler: slurm\n")
    assert api.clusters_asked("any") == ["alpha", "zeta"]  # the user's own, not the shipped examples
    for bad in ("a,", "a,a"):
        with pytest.raises(InputError, match="distinct profile names"):
            api.clusters_asked(bad)


def test_the_soonest_start_wins_and_a_tie_goes_to_the_first_asked() -> None:
    from meshrun.submit.api import Candidate, soonest

    late = Candidate("a", "debug", "2026-12-03T23:00:00", "")
    early = Candidate("b", "gpu", "2026-12-03T22:00:00", "")
    also = Candidate("c", "gpu", "2026-12-03T22:00:00", "")
    never = Candidate("d", "-", None, "Slurm refuses the request")
    assert soonest([late, early, also, never]) is early
    assert soonest([late, Candidate("local", "-", "now", "")]).cluster == "local"
    assert soonest([never]) is None and not never.ok


def test_a_local_cluster_among_the_asked_is_planned_and_checked_like_any(tmp_path: Path) -> None:
    from meshrun.submit import api

    found = api.candidates(
        REPO / "examples" / "tiny.yaml", ["local", "no-such-profile"], [f"data.path={_plan(tmp_path).spec.data.path}"]
    )
    assert [(c.cluster, c.ok) for c in found] == [("local", True), ("no-such-profile", False)], found
    assert found[0].start == "now" and "no such cluster" in found[1].why
