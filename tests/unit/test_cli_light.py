"""The caller's side stays torch-free, fast and traceback-free."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(args: list[str], tmp_path: Path, block_torch: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, XDG_STATE_HOME=str(tmp_path / "state"), XDG_CONFIG_HOME=str(tmp_path / "config"))
    if block_torch:
        # A `torch` that cannot be imported: the laptop without torch installed.
        fake = tmp_path / "notorch" / "torch"
        fake.mkdir(parents=True, exist_ok=True)
        (fake / "__init__.py").write_text("raise ImportError('torch is not installed on this laptop')\n")
        env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "notorch"), str(REPO)])
    return subprocess.run(
        [sys.executable, "-m", "meshrun.submit.cli.main", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=60,
    )


def test_help_and_render_work_without_torch(tmp_path: Path) -> None:
    assert _run(["--help"], tmp_path).returncode == 0
    out = _run(["render", "examples/two-node.yaml", "-c", "testbed"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("#!/bin/bash") and "srun --kill-on-bad-exit=1" in out.stdout


def test_submit_side_modules_never_import_torch() -> None:
    code = (
        "import sys; import meshrun.submit.cli.main, meshrun.submit.api, meshrun.submit.schedulers.render, meshrun.submit.planning.plan, meshrun.submit.schedulers.local, meshrun.submit.schedulers.slurm, "
        "meshrun.submit.core.registry, meshrun.submit.schedulers.slurm_cli, meshrun.submit.transport.base, meshrun.launcher.contract.spec.job, meshrun.launcher.rank.entry; "
        "bad = [m for m in ('torch', 'numpy', 'paramiko') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_bad_input_is_one_line_exit_2_no_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nresources: {nodes: 1, tasks_per_nod: 2}\n")
    for args in (
        ["render", str(bad)],
        ["submit", str(bad), "--dry-run"],
        ["render", "examples/tiny.yaml", "--set", "parallel.dp=3"],
        ["render", "examples/tiny.yaml", "-c", "nosuchcluster"],
        ["submit", "examples/tiny.yaml", "--set", "train.steps=x"],
        ["status", "12345"],
        ["logs", "12345"],
        ["cancel", "12345"],
        # A new user's trial: a mistyped cluster listed nothing with exit 0; argparse's own errors
        # printed the usage block.
        ["status", "-c", "nosuchcluster"],
        ["top", "--once", "-c", "nosuchcluster"],
        ["watch", "-c", "nosuchcluster"],
        ["export", "12345", "-o", "x", "--format", "onnx"],
        ["export"],
        ["status", "-n", "-5"],
    ):
        out = _run(args, tmp_path)
        assert out.returncode == 2, (args, out.stderr)
        assert "Traceback" not in out.stderr and out.stderr.count("\n") == 1, out.stderr
        assert out.stderr.startswith("meshrun") and ": error: " in out.stderr and "usage:" not in out.stderr


def test_errors_name_what_the_user_gave(tmp_path: Path) -> None:
    """The trial's findings: the cluster from $MESHRUN_CLUSTER is named as such (not as -c, never typed), and
    an unknown --set key shows the override and the name that is wrong (not the value it would set)."""
    env_cluster = subprocess.run(
        [sys.executable, "-m", "meshrun.submit.cli.main", "submit", "examples/tiny.yaml", "--dry-run"],
        capture_output=True,
        text=True,
        env=dict(os.environ, MESHRUN_CLUSTER="nosuch", XDG_CONFIG_HOME=str(tmp_path / "config")),
        cwd=REPO,
    )
    assert env_cluster.returncode == 2
    assert env_cluster.stderr.startswith("meshrun: error: $MESHRUN_CLUSTER: 'nosuch': no such cluster"), (
        env_cluster.stderr
    )
    typo = _run(["submit", "examples/tiny.yaml", "--set", "trian.steps=10", "--dry-run"], tmp_path)
    assert typo.stderr.startswith("meshrun: error: --set trian.steps=10: 'trian': unknown key (did you mean 'train'?)")
    deep = _run(["submit", "examples/tiny.yaml", "--set", "train.stpes=10", "--dry-run"], tmp_path)
    assert deep.stderr.startswith("meshrun: error: --set train.stpes=10: 'stpes': unknown key (did you mean 'steps'?)")
    # a typo'd section in the file: named by its keys, not printed whole (it was 458 characters with the valid keys)
    spec = tmp_path / "typo.yaml"
    spec.write_text("name: x\ntrian:\n  steps: 5\n  lr: 1.0e-3\n")
    section = _run(["submit", str(spec), "-c", "local", "--dry-run"], tmp_path)
    assert section.returncode == 2 and section.stderr.startswith(
        f"meshrun: error: {spec}:2: trian: {{steps: ..., lr: ...}}: unknown key (did you mean 'train'?); valid keys: "
    ), section.stderr


def test_dry_run_touches_nothing(tmp_path: Path) -> None:
    # A token file of its own: submit (--dry-run too) refuses a missing one, and the spec's default lives in
    # the real home, which a fresh machine has not built.
    data = tmp_path / "tokens.u16"
    data.write_bytes(bytes(2 * 4096))
    out = _run(["submit", "examples/tiny.yaml", "--dry-run", "--json", "--set", f"data.path={data}"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert '"accumulation": 2' in out.stdout
    assert not (tmp_path / "state").exists()


def test_bad_alert_thresholds_and_an_unknown_rule_are_refused_before_submission(tmp_path: Path) -> None:
    cases = {
        "alerts.loss_spike_factor=0.5": "alerts.loss_spike_factor: 0.5: give a factor above 1",
        "alerts.gpu_memory_fraction=1.5": "alerts.gpu_memory_fraction: 1.5: give a fraction between 0 and 1",
        "alerts.window=1": "alerts.window: 1: give 2 to 100000 logged steps",
        "alerts.nan_loss=true": "unknown key",
    }
    for override, message in cases.items():
        out = _run(["submit", "examples/tiny.yaml", "-c", "local", "--dry-run", "--set", override], tmp_path)
        assert out.returncode == 2 and message in out.stderr, (override, out.stderr)
        assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    spec = tmp_path / "job.yaml"  # in the file too, with its line
    spec.write_text("name: x\nalerts:\n  grad_norm_spike: 3\n")
    out = _run(["submit", str(spec), "-c", "local", "--dry-run"], tmp_path)
    assert out.returncode == 2 and f"{spec}:3: alerts.grad_norm_spike" in out.stderr, out.stderr
    assert "did you mean 'grad_norm_spike_factor'?" in out.stderr
