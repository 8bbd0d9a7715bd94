"""Secrets (spec `secrets:`): names and sources are checked before anything touches a cluster, an error never
echoes a value, spec.json holds names and sources only, a value travels only through `put`'s input (never an
argv), the ranks read private files only, and the secrets folder lies outside the run dir and goes at the end."""

from __future__ import annotations

import json
import os
import secrets as stdlib_secrets
import sys
import types
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import pytest

from meshrun.launcher.batch import requeue
from meshrun.launcher.contract.spec import secrets as ls
from meshrun.launcher.contract.spec.job import JobSpec, RunInfo, RunSpec, dumps_run_spec, loads_run_spec, write_run_spec
from meshrun.launcher.contract.spec.schema import SchemaError, load
from meshrun.submit.config.cluster import load_profile
from meshrun.submit.core import secrets as job_secrets
from meshrun.submit.errors import InputError
from meshrun.submit.planning.plan import describe, plan_file
from meshrun.submit.schedulers import backend
from meshrun.submit.transport.base import LocalTransport, Result, Upload

REPO = Path(__file__).resolve().parents[2]
COMMAND = REPO / "examples" / "command.yaml"


def _token() -> str:
    return f"sk-{stdlib_secrets.token_hex(16)}"


def _job(secrets: Any, env: Optional[dict[str, str]] = None) -> JobSpec:
    return load(JobSpec, {"name": "x", "command": ["true"], "secrets": secrets, "env": env or {}})


def _private(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


# ----------------------------------------------------------------------------------------- the spec key


@pytest.mark.parametrize(
    "given, key, fix",
    [
        ({"bad-name": {"env": "A"}}, "secrets.bad-name", "[A-Za-z_][A-Za-z0-9_]*"),
        ({"1X": {"env": "A"}}, "secrets.1X", "[A-Za-z_][A-Za-z0-9_]*"),
        ({"RANK": {"env": "A"}}, "secrets.RANK", "meshrun or the scheduler sets"),
        ({"MESHRUN_RUN_DIR": {"env": "A"}}, "secrets.MESHRUN_RUN_DIR", "meshrun or the scheduler sets"),
        ({"SLURM_JOB_ID": {"env": "A"}}, "secrets.SLURM_JOB_ID", "meshrun or the scheduler sets"),
        ({"TOK": {"env": "A", "file": "/f"}}, "secrets.TOK", "exactly one of env: and file:"),
        ({"TOK": {}}, "secrets.TOK", "exactly one of env: and file:"),
        ({"TOK": {"env": "not-a-var"}}, "secrets.TOK.env", "name an environment variable"),
        ({"TOK": {"file": "relative/token"}}, "secrets.TOK.file", "absolute path"),
    ],
)
def test_bad_names_and_sources_name_the_key_and_the_fix(given: Any, key: str, fix: str) -> None:
    with pytest.raises(SchemaError) as err:
        _job(given)
    assert err.value.key == key and fix in err.value.fix, str(err.value)


def test_a_name_also_in_env_is_refused() -> None:
    with pytest.raises(SchemaError, match=r"secrets\.TOK: 'TOK': TOK is also in env:"):
        _job({"TOK": {"env": "A"}}, env={"TOK": "x"})


@pytest.mark.parametrize("shape", ["inline", "value_key", "section", "env_holds_it", "file_holds_it"])
def test_a_value_written_where_a_source_belongs_is_refused_without_echoing_it(shape: str) -> None:
    token = _token()
    given: Any = {
        "inline": {"TOK": token},
        "value_key": {"TOK": {"value": token}},
        "section": token,
        "env_holds_it": {"TOK": {"env": token}},
        "file_holds_it": {"TOK": {"file": token}},
    }[shape]
    with pytest.raises(SchemaError) as err:
        _job(given)
    assert token not in str(err.value) and ls.HIDDEN in str(err.value), str(err.value)


def test_the_cli_refuses_an_inline_value_in_one_line_without_echoing_it(tmp_path: Path) -> None:
    import subprocess

    token = _token()
    spec = tmp_path / "job.yaml"
    spec.write_text(f"name: x\ncommand: ['true']\nsecrets:\n  TOK: {token}\n")
    done = subprocess.run(
        [sys.executable, "-m", "meshrun.submit.cli.main", "submit", str(spec), "-c", "local", "--dry-run"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "HOME": str(tmp_path)},
    )
    assert done.returncode == 2 and token not in done.stdout + done.stderr, done
    (line,) = done.stderr.strip().splitlines()
    assert "secrets.TOK" in line and "never the value" in line, line


def test_spec_json_holds_names_and_sources_and_no_key_at_all_without_secrets() -> None:
    info = RunInfo(cluster="c", scheduler="slurm", run_dir="/w/runs/x")
    plain = json.loads(dumps_run_spec(RunSpec(_job({}), info)))
    assert "secrets" not in plain["job"]  # a job without secrets renders byte for byte as before the key
    spec = _job({"TOK": {"env": "SRC"}, "HF": {"file": "~/.hf"}})
    text = dumps_run_spec(RunSpec(spec, info))
    assert json.loads(text)["job"]["secrets"] == {
        "TOK": {"env": "SRC", "file": None},
        "HF": {"env": None, "file": "~/.hf"},
    }
    back = loads_run_spec(text, "spec.json")
    assert back.job.secrets == spec.secrets and back.job.secrets["TOK"] == ls.SecretSource(env="SRC")


# ------------------------------------------------------------------------------------------- plan time


def test_plan_refuses_a_missing_env_source_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MESHRUN_T_SRC", raising=False)
    with pytest.raises(InputError) as err:
        plan_file(COMMAND, load_profile("local"), ["secrets.TOK.env=MESHRUN_T_SRC"], home="/home/u", run_dir="/r")
    assert err.value.key == "secrets.TOK.env" and "MESHRUN_T_SRC is not set" in err.value.fix


def test_plan_refuses_an_empty_env_source(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHRUN_T_SRC", "")
    with pytest.raises(InputError, match="empty"):
        plan_file(COMMAND, load_profile("local"), ["secrets.TOK.env=MESHRUN_T_SRC"], home="/home/u", run_dir="/r")


def test_plan_refuses_a_name_the_cluster_network_preset_sets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SRC", "v")
    with pytest.raises(InputError, match="network preset sets NCCL_SOCKET_IFNAME"):
        plan_file(COMMAND, load_profile("testbed"), ["secrets.NCCL_SOCKET_IFNAME.env=SRC"], home="/h", run_dir="/r")


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660])
def test_plan_refuses_a_file_others_can_read_with_the_chmod_fix(tmp_path: Path, mode: int) -> None:
    path = _private(tmp_path / "token", _token(), mode)
    with pytest.raises(InputError) as err:
        plan_file(COMMAND, load_profile("local"), [f"secrets.TOK.file={path}"], home=str(tmp_path), run_dir="/r")
    assert err.value.key == "secrets.TOK.file" and err.value.value == str(path)
    assert f"mode {mode:04o}" in err.value.fix and f"chmod 600 {path}" in err.value.fix


def test_plan_checks_a_file_only_where_it_is_visible(tmp_path: Path) -> None:
    from meshrun.submit.planning.plan import REMOTE_HOME

    path = tmp_path / "absent"
    profile = load_profile("local")
    with pytest.raises(InputError, match="no such file"):
        plan_file(COMMAND, profile, [f"secrets.TOK.file={path}"], home=str(tmp_path), run_dir="/r")
    plan = plan_file(COMMAND, profile, [f"secrets.TOK.file={path}"], home=REMOTE_HOME, run_dir="~/r")
    assert describe(plan)["secrets"] == {"TOK": f"file:{path}"}  # over SSH: the ranks check it


# ------------------------------------------------------------------------------------- the rank's read


def test_a_private_file_is_read_with_one_trailing_newline_dropped(tmp_path: Path) -> None:
    token = _token()
    assert ls.read_private_file("k", str(_private(tmp_path / "a", token + "\n"))) == token
    assert ls.read_private_file("k", str(_private(tmp_path / "b", token + "\r\n", 0o400))) == token
    assert ls.read_private_file("k", str(_private(tmp_path / "c", token + "\n\n"))) == token + "\n"


@pytest.mark.parametrize(
    "content, fix", [("", "empty"), ("\n", "empty"), ("a\0b", "NUL"), ("x" * (ls.MAX_BYTES + 1), "KiB")]
)
def test_an_unusable_value_is_refused_without_showing_it(tmp_path: Path, content: str, fix: str) -> None:
    path = _private(tmp_path / "t", content)
    with pytest.raises(SchemaError) as err:
        ls.read_private_file("secrets.T.file", str(path))
    assert fix in err.value.fix and err.value.value == str(path)


def test_a_folder_a_symlink_to_a_readable_file_and_another_users_file_are_refused(tmp_path: Path) -> None:
    with pytest.raises(SchemaError, match="not a regular file"):
        ls.read_private_file("k", str(tmp_path))
    target = _private(tmp_path / "shared", _token(), 0o644)
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(SchemaError, match="chmod 600"):  # the checks run on what was opened
        ls.read_private_file("k", str(tmp_path / "link"))
    if os.geteuid() == 0:  # root can give a file away: owned by nobody, it is not this user's secret
        other = _private(tmp_path / "other", _token())
        os.chown(other, 65534, 65534)
        with pytest.raises(SchemaError, match="owned by another user"):
            ls.read_private_file("k", str(other))


def test_the_rank_reads_env_sources_from_the_secrets_folder_and_file_sources_in_place(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "job-1"
    folder = Path(ls.secrets_dir_for(str(run_dir)))
    folder.mkdir(parents=True, mode=0o700)
    sent, kept = _token(), _token()
    _private(folder / "TOK", sent)
    spec = _job({"TOK": {"env": "SRC"}, "HF": {"file": str(_private(tmp_path / "hf", kept))}})
    environ: dict[str, str] = {}
    assert ls.apply(spec.secrets, str(run_dir), environ) == ["HF", "TOK"]
    assert environ == {"TOK": sent, "HF": kept}
    (folder / "TOK").unlink()
    with pytest.raises(SchemaError, match="`meshrun resume` sends it again"):
        ls.apply(spec.secrets, str(run_dir), {})


def test_run_rank_sets_the_secrets_before_the_trainer_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from meshrun.launcher.rank import entry

    token = _token()
    run_dir = tmp_path / "runs" / "job-1"
    run_dir.mkdir(parents=True)
    spec = load(JobSpec, {"name": "x", "secrets": {"WANDB_API_KEY": {"file": str(_private(tmp_path / "t", token))}}})
    write_run_spec(RunSpec(spec, RunInfo(cluster="c", scheduler="local", run_dir=str(run_dir))), run_dir)
    seen: dict[str, Optional[str]] = {}

    def train(run_spec: Any, env: Any, flag: Any) -> int:
        seen["key"] = os.environ.get("WANDB_API_KEY")
        return 0

    # A stand-in for meshrun.launcher.train.loop (torch-free): what the built-in trainer's rank sees.
    monkeypatch.setitem(sys.modules, "meshrun.launcher.train.loop", types.SimpleNamespace(train=train))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    for key in ("SLURM_PROCID", "SLURM_NTASKS", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(os, "environ", os.environ.copy())  # what the rank sets stays in this test
    assert entry.run_rank(str(run_dir)) == 0
    assert seen["key"] == token
    assert token not in "".join(p.read_text(errors="replace") for p in run_dir.rglob("*") if p.is_file())


# -------------------------------------------------------------------------------- the folder, its end


def test_the_secrets_folder_lies_beside_the_run_dir_never_inside() -> None:
    assert ls.secrets_dir_for("/w/runs/job-1") == "/w/runs/.job-1.secrets"
    assert ls.secrets_dir_for("/w/runs/job-1/") == "/w/runs/.job-1.secrets"
    assert ls.secrets_dir_for("/w/runs/sweep/tasks/3") == "/w/runs/.sweep.secrets/tasks/3"
    for run_dir in ("/w/runs/job-1", "/w/runs/sweep/tasks/3"):
        assert not ls.secrets_dir_for(run_dir).startswith(run_dir.rsplit("/tasks/", 1)[0] + "/")


def test_remove_dir_removes_only_secrets_folders_and_a_sweep_once_its_last_task_is_gone(tmp_path: Path) -> None:
    decoy = tmp_path / "precious"
    decoy.mkdir()
    ls.remove_dir(str(decoy))  # not a name secrets_dir_for makes: an edited spec cannot aim it elsewhere
    assert decoy.exists()
    sweep = tmp_path / "runs" / "sweep"
    for task in (0, 1):
        Path(ls.secrets_dir_for(f"{sweep}/tasks/{task}")).mkdir(parents=True)
        (Path(ls.secrets_dir_for(f"{sweep}/tasks/{task}")) / "TOK").write_text("v")
    root = Path(ls.secrets_dir_for(str(sweep)))
    ls.remove_dir(ls.secrets_dir_for(f"{sweep}/tasks/0"))
    assert root.exists() and not (root / "tasks" / "0").exists()  # task 1 still needs its own
    ls.remove_dir(ls.secrets_dir_for(f"{sweep}/tasks/1"))
    assert not root.exists()


@pytest.mark.parametrize("status, removed", [(0, True), (2, True), (75, False)])
def test_the_final_requeue_decision_removes_the_folder_a_requeue_keeps_it(
    tmp_path: Path, status: int, removed: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "runs" / "job-1"
    run_dir.mkdir(parents=True)
    write_run_spec(RunSpec(_job({}), RunInfo(cluster="c", scheduler="slurm", run_dir=str(run_dir))), run_dir)
    folder = Path(ls.secrets_dir_for(str(run_dir)))
    folder.mkdir(mode=0o700)
    (folder / "TOK").write_text("v")
    if status == 2:  # meshrun's bad-input verdict comes with a rank error line (a program's own 2 is requeued)
        (run_dir / "rank-error.txt").write_text("rank 0: data.path: '/x': no token file there\n")
    assert requeue.main([str(run_dir), str(status), "0", "20"]) == 0
    assert capsys.readouterr().out.startswith("stop" if removed else "requeue")
    assert folder.exists() is not removed


# ---------------------------------------------------------------------------------- what travels where


class Recording(LocalTransport):
    """This machine, recording every command line and every file a `put` writes."""

    def __init__(self) -> None:
        super().__init__()
        self.argvs: list[list[str]] = []
        self.puts: list[tuple[str, dict[str, Upload]]] = []

    def run(self, argv: Sequence[str], *args: Any, **kwargs: Any) -> Result:
        self.argvs.append(list(argv))
        return super().run(argv, *args, **kwargs)

    def put(self, files: Mapping[str, Upload], dest: str, *args: Any, **kwargs: Any) -> Optional[Result]:
        self.puts.append((dest, dict(files)))
        return super().put(files, dest, *args, **kwargs)


def test_a_value_travels_only_as_put_data_into_the_private_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    token = _token()
    monkeypatch.setenv("MESHRUN_T_SRC", token)
    run_dir = tmp_path / "runs" / "job-1"
    plan = plan_file(
        COMMAND, load_profile("testbed"), ["secrets.TOK.env=MESHRUN_T_SRC"], home="/h", run_dir=str(run_dir)
    )
    request = backend("slurm").dryrun(plan)
    shown = json.dumps(request.as_json()) + repr(request) + json.dumps(describe(plan))
    assert token not in shown and "env:MESHRUN_T_SRC" in shown
    # sbatch (whose environment slurmdbd stores and the job inherits) runs without the name or its source
    assert request.argv[:5] == ("env", "-u", "MESHRUN_T_SRC", "-u", "TOK") and request.argv[5] == "sbatch"
    assert all(token.encode() not in upload.data for upload in request.files.values() if isinstance(upload.data, bytes))
    transport = Recording()
    job_secrets.send(request.secrets_dir, request.secrets, transport)
    assert not any(token in word for argv in transport.argvs for word in argv)
    ((dest, files),) = transport.puts
    assert dest == str(tmp_path / "runs" / ".job-1.secrets") and files["TOK"].mode == 0o600
    folder = Path(dest)
    assert (folder / "TOK").read_text() == token and oct(folder.stat().st_mode & 0o777) == "0o700"
    assert oct((folder / "TOK").stat().st_mode & 0o777) == "0o600"


def test_a_sweep_sends_each_task_its_own_folder(monkeypatch: pytest.MonkeyPatch) -> None:
    from meshrun.submit.planning.sweep import plan_sweep
    from meshrun.submit.schedulers.base import secret_files

    monkeypatch.setenv("SRC", "v")
    plan = plan_sweep(COMMAND, load_profile("testbed"), ["secrets.TOK.env=SRC"], ["env.X=5,6"], home="/h")
    folder, files = secret_files(plan)
    assert folder == ls.secrets_dir_for(plan.run_dir) and files == {"tasks/0/TOK": "SRC", "tasks/1/TOK": "SRC"}
    assert [ls.secrets_dir_for(t.run_dir) for t in plan.tasks] == [f"{folder}/tasks/0", f"{folder}/tasks/1"]


def test_cancel_removes_a_job_or_a_whole_array() -> None:
    assert job_secrets.forget_argv(["/w/runs/a"], whole_array=False) == ["rm", "-rf", "--", "/w/runs/.a.secrets"]
    tasks = ["/w/runs/s/tasks/0", "/w/runs/s/tasks/1"]
    assert job_secrets.forget_argv(tasks, whole_array=True) == ["rm", "-rf", "--", "/w/runs/.s.secrets"]


def test_a_job_without_secrets_starts_exactly_as_before() -> None:
    plan = plan_file(COMMAND, load_profile("testbed"), [], home="/h", run_dir="/w/runs/a")
    request = backend("slurm").dryrun(plan)
    assert request.argv[0] == "sbatch" and request.secrets_dir == "" and not request.secrets
    assert "secrets" not in describe(plan)
