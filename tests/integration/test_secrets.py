"""Secrets through the real CLI (each test its own HOME, a random token per test): the value reaches the rank
(the program compares its hash and exits 0 or 1, never printing it) and is found nowhere else: not in any file
of the run dir, the registry, the logs, the CLI's output, nor, on the real Slurm testbed (slurmdbd storing job
scripts and job environments), in `sacct --batch-script`, `sacct --env-vars`, `scontrol show job -dd` or
`scontrol write batch_script`; its folder is private while the job lives and gone once it ended or was
cancelled; over the real sshd as on a login node; on `local`; and bad input is refused before any cluster."""

from __future__ import annotations

import hashlib
import os
import secrets
import subprocess
import time
from pathlib import Path
from typing import Any

import yaml

from meshrun.launcher.contract.spec.secrets import secrets_dir_for
from meshrun.submit.config.cluster import load_profile
from tests.helpers import sshbed
from tests.helpers.cli import meshrun, submitted

# Exits 0 when every NAME in $CHECK holds the value whose sha256 is in $WANT_NAME and no variable in $ABSENT
# (the sources in meshrun submit's environment) reached the rank, else 1; prints nothing of a value.
PROGRAM = (
    "import hashlib, os, sys; "
    "names = os.environ['CHECK'].split(); "
    "ok = all(hashlib.sha256(os.environ.get(n, '').encode()).hexdigest() == os.environ['WANT_' + n] for n in names); "
    "ok = ok and not any(n in os.environ for n in os.environ.get('ABSENT', '').split()); "
    "print('secrets match' if ok else 'secrets differ', flush=True); sys.exit(0 if ok else 1)"
)


def _token() -> str:
    return f"sk-{secrets.token_hex(20)}"


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _spec(folder: Path, name: str, sources: dict[str, dict[str, str]], tokens: dict[str, str], **extra: Any) -> Path:
    """A command job checking each secret against its token's hash (hashes may be written; tokens never)."""
    env = {"CHECK": " ".join(tokens), **{f"WANT_{n}": _sha(t) for n, t in tokens.items()}}
    env["ABSENT"] = " ".join(s["env"] for s in sources.values() if "env" in s)
    spec = {
        "name": name,
        "resources": {"nodes": 1, "tasks_per_node": 1, "time": "00:05:00"},
        "command": extra.pop("command", ["python3", "-c", PROGRAM]),
        "env": env,
        "secrets": sources,
        **extra,
    }
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def _private_file(path: Path, token: str) -> Path:
    path.write_text(token + "\n")
    path.chmod(0o600)
    return path


def _files_holding(token: str, *roots: Path) -> list[str]:
    needle = token.encode()
    found = []
    for root in roots:
        for path in [root] if root.is_file() else root.rglob("*"):
            if path.is_file() and not path.is_symlink() and needle in path.read_bytes():
                found.append(str(path))
    return found


def _slurm_record(job_id: str) -> dict[str, str]:
    """What Slurm keeps of the job: the stored script and environment (slurmdbd), and slurmctld's record."""
    queries = {
        "sacct --batch-script": ["sacct", "-j", job_id, "--batch-script"],
        "sacct --env-vars": ["sacct", "-j", job_id, "--env-vars"],
        "scontrol show job -dd": ["scontrol", "show", "job", "-dd", job_id],
        "scontrol write batch_script": ["scontrol", "write", "batch_script", job_id, "-"],
    }
    deadline = time.monotonic() + 20
    while True:  # slurmdbd stores the script and environment shortly after the job starts
        out = {k: subprocess.run(a, capture_output=True, text=True).stdout for k, a in queries.items()}
        if ("SLURM_CONF=" in out["sacct --env-vars"] and "#SBATCH" in out["sacct --batch-script"]) or (
            time.monotonic() > deadline
        ):
            break
        time.sleep(0.2)
    # Not vacuous: each answer holds the job's script or environment, where a leaked value would show.
    assert "SLURM_CONF=" in out["sacct --env-vars"], out["sacct --env-vars"]
    assert "#SBATCH" in out["sacct --batch-script"] and "#SBATCH" in out["scontrol write batch_script"], out
    assert f"JobId={job_id}" in out["scontrol show job -dd"], out["scontrol show job -dd"]
    return out


def _assert_written_nowhere(token: str, home: Path, run_dir: Path, job_id: str, *outputs: str) -> None:
    assert not _files_holding(token, run_dir, home / "state"), "a secret was written into the run dir or registry"
    assert all(token not in text for text in outputs), "a secret was printed"
    if not job_id.startswith("local-"):
        leaks = [where for where, text in _slurm_record(job_id).items() if token in text]
        assert not leaks, f"a secret is in Slurm's record: {leaks}"


def test_env_and_file_secrets_reach_the_rank_and_slurm_keeps_neither(testbed: dict, tmp_path: Path) -> None:
    from_env, from_file = _token(), _token()
    tokens = {"WANDB_API_KEY": from_env, "HF_TOKEN": from_file}
    sources = {
        "WANDB_API_KEY": {"env": "MY_WANDB"},
        "HF_TOKEN": {"file": str(_private_file(tmp_path / "hf", from_file))},
    }
    spec = _spec(tmp_path, "secret-probe", sources, tokens)
    # The login node's environment holds the source AND the target name: sbatch must pass neither on.
    env = {"MY_WANDB": from_env, "WANDB_API_KEY": from_env, "HF_TOKEN": from_file}
    out = meshrun(tmp_path, "submit", str(spec), "-c", "testbed", "--wait", env=env)
    job_id, run_dir = submitted(out)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "secrets match" in (run_dir / "logs" / "rank-0.log").read_text()
    assert not Path(secrets_dir_for(str(run_dir))).exists()  # the final requeue decision removed it
    for token in tokens.values():
        _assert_written_nowhere(token, tmp_path, run_dir, job_id, out.stdout, out.stderr)


def test_the_folder_is_private_outside_the_run_dir_until_cancel(testbed: dict, tmp_path: Path) -> None:
    token = _token()
    spec = _spec(tmp_path, "secret-sleeper", {"TOKEN": {"env": "SRC"}}, {"TOKEN": token}, command=["sleep", "300"])
    out = meshrun(tmp_path, "submit", str(spec), "-c", "testbed", "--dry-run", env={"SRC": token})
    assert out.returncode == 0 and "'TOKEN': 'env:SRC'" in out.stdout and token not in out.stdout + out.stderr
    out = meshrun(tmp_path, "submit", str(spec), "-c", "testbed", env={"SRC": token}, check=True)
    job_id, run_dir = submitted(out)
    folder = Path(secrets_dir_for(str(run_dir)))
    assert folder.parent == run_dir.parent and (folder / "TOKEN").read_text() == token
    assert folder.stat().st_mode & 0o777 == 0o700 and (folder / "TOKEN").stat().st_mode & 0o777 == 0o600
    meshrun(tmp_path, "cancel", job_id, check=True)
    assert not folder.exists()
    _assert_written_nowhere(token, tmp_path, run_dir, job_id, out.stdout)


def test_over_ssh_the_value_travels_in_the_channel_and_reaches_the_rank(testbed: dict, tmp_path: Path) -> None:
    token = _token()
    profile = sshbed.profile(tmp_path)
    root = sshbed.project(tmp_path, {})
    spec = _spec(root, "secret-ssh", {"TOKEN": {"env": "LAPTOP_TOKEN"}}, {"TOKEN": token})
    log_before = sshbed.SSHD_LOG.stat().st_size if sshbed.SSHD_LOG.exists() else 0
    out = sshbed.meshrun(tmp_path, "submit", str(spec), "-c", str(profile), "--wait", env={"LAPTOP_TOKEN": token})
    job_id, run_dir = submitted(out)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "secrets match" in (run_dir / "logs" / "rank-0.log").read_text()
    assert not Path(secrets_dir_for(str(run_dir))).exists()
    _assert_written_nowhere(token, tmp_path, run_dir, job_id, out.stdout, out.stderr)
    assert token.encode() not in sshbed.SSHD_LOG.read_bytes()[log_before:]


def test_on_the_local_cluster_too(tmp_path: Path) -> None:
    from_env, from_file = _token(), _token()
    tokens = {"API_KEY": from_env, "HF_TOKEN": from_file}
    sources = {"API_KEY": {"env": "SRC"}, "HF_TOKEN": {"file": str(_private_file(tmp_path / "hf", from_file))}}
    spec = _spec(tmp_path, "secret-local", sources, tokens)
    out = meshrun(tmp_path, "submit", str(spec), "-c", "local", "--wait", env={"SRC": from_env, "API_KEY": from_env})
    job_id, run_dir = submitted(out)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "secrets match" in (run_dir / "logs" / "rank-0.log").read_text()
    assert not Path(secrets_dir_for(str(run_dir))).exists()  # the supervisor removed it at the end
    for token in tokens.values():
        _assert_written_nowhere(token, tmp_path, run_dir, job_id, out.stdout, out.stderr)


def test_bad_input_is_refused_in_one_line_before_any_cluster(testbed: dict, tmp_path: Path) -> None:
    token = _token()
    readable = tmp_path / "readable"
    readable.write_text(token)
    readable.chmod(0o644)
    cases = {
        "missing": (
            {"TOKEN": {"env": "NOT_SET_ANYWHERE"}},
            "secrets.TOKEN.env: 'NOT_SET_ANYWHERE': NOT_SET_ANYWHERE is not set",
        ),
        "readable": (
            {"TOKEN": {"file": str(readable)}},
            f"secrets.TOKEN.file: '{readable}': mode 0644 lets others read it; run `chmod 600 {readable}`",
        ),
        "badname": ({"bad-name": {"env": "SRC"}}, "secrets.bad-name: 'bad-name': environment variable names match"),
    }
    env = {k: v for k, v in os.environ.items() if k != "NOT_SET_ANYWHERE"}
    nonce = secrets.token_hex(4)  # the testbed's work dir is shared: look for this test's runs only
    for case, (sources, message) in cases.items():
        spec = _spec(tmp_path, f"secret-bad-{case}-{nonce}", sources, {})
        out = meshrun(tmp_path, "submit", str(spec), "-c", "testbed", env={**env, "SRC": token})
        assert out.returncode == 2 and token not in out.stdout + out.stderr, (case, out)
        (line,) = out.stderr.strip().splitlines()
        assert message in line, (case, line)
    runs = Path(load_profile("testbed").paths.work_dir) / "runs"
    assert not list(runs.glob(f"secret-bad-*-{nonce}-*")) and not list(runs.glob(f".secret-bad-*-{nonce}-*"))
    assert not list((tmp_path / "state").rglob("*.sqlite"))  # nothing was recorded: nothing was submitted


def test_resume_sends_the_value_again_from_the_environment_it_runs_in(tmp_path: Path) -> None:
    first, second = _token(), _token()
    spec = _spec(tmp_path, "secret-resume", {"API_KEY": {"env": "SRC"}}, {"API_KEY": second})
    out = meshrun(tmp_path, "submit", str(spec), "-c", "local", "--wait", env={"SRC": first})
    job_id, run_dir = submitted(out)
    assert out.returncode == 1 and "secrets differ" in (run_dir / "logs" / "rank-0.log").read_text()
    assert not Path(secrets_dir_for(str(run_dir))).exists()  # gone with the failed run
    env = {k: v for k, v in os.environ.items() if k != "SRC"}
    missing = meshrun(tmp_path, "resume", job_id, env=env)
    assert missing.returncode == 2 and "SRC is not set" in missing.stderr, missing
    out = meshrun(tmp_path, "resume", job_id, "--wait", env={"SRC": second})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "secrets match" in (run_dir / "logs" / "rank-0.log").read_text()
    for token in (first, second):
        _assert_written_nowhere(token, tmp_path, run_dir, "local-", out.stdout, out.stderr)


def test_a_rank_refuses_a_file_others_can_read_where_submit_could_not_see_it(testbed: dict, tmp_path: Path) -> None:
    readable = tmp_path / "readable"
    readable.write_text(_token())
    readable.chmod(0o644)
    profile = sshbed.profile(tmp_path)
    spec = _spec(sshbed.project(tmp_path, {}), "secret-rank-check", {"TOKEN": {"file": str(readable)}}, {})
    # A laptop cannot see the cluster's file: the preflight asks the cluster, and refuses before anything queues.
    checked = sshbed.meshrun(tmp_path, "submit", str(spec), "-c", str(profile))
    assert checked.returncode == 2 and "submitted" not in checked.stdout, checked
    assert f"preflight: files: secrets.TOKEN: {readable} is readable by others on the cluster" in checked.stderr
    # Past the preflight (`--no-check`), the ranks check it themselves when they start.
    out = sshbed.meshrun(tmp_path, "submit", str(spec), "-c", str(profile), "--wait", "--no-check")
    job_id, run_dir = submitted(out)
    assert out.returncode == 2, out.stdout + out.stderr  # the ranks' bad input: exit 2, not requeued
    reason = (run_dir / "rank-error.txt").read_text()
    assert f"secrets.TOKEN.file: '{readable}': mode 0644 lets others read it; run `chmod 600 {readable}`" in reason
