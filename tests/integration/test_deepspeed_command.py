"""A user's own DeepSpeed script as a `command:` job (examples/deepspeed-command.yaml): 2 CPU ranks whose
deepspeed.init_distributed() finds everything in the environment meshrun sets, train under ZeRO-2 and
report their loss, on `local` and on the real 2-node Slurm testbed."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from meshrun.launcher.contract.records.rundir import RunDir
from tests.helpers.cli import meshrun, submitted

SPEC = "examples/deepspeed-command.yaml"
STEPS = 12
# The job's python3 is this venv's, as after `source .venv/bin/activate` (CI runs pytest without it).
VENV_PATH = {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}


def check_trained(run_dir: Path, ranks: int) -> None:
    """Every step reported once by rank 0, the loss going down, DeepSpeed on CPU/gloo without probing."""
    rows = [json.loads(l) for l in Path(RunDir(str(run_dir)).metrics).read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1)), rows
    losses = [r["loss"] for r in steps]
    assert sum(losses[-3:]) < 0.5 * sum(losses[:3]), losses  # it learns (a fixed seed: the same numbers each run)
    log = (run_dir / "logs" / "rank-0.log").read_text()
    assert f"step {STEPS} loss" in log and f"zero 2 world {ranks}" in log, log
    # DeepSpeed names the accelerator it was told; it warns "Setting accelerator to CPU" only when it
    # had to probe, i.e. when meshrun did not set DS_ACCELERATOR for this GPU-less job.
    assert "Setting accelerator to CPU" not in log and "Traceback" not in log, log


needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="the deepspeed extra is not installed (bash scripts/setup.sh installs it)",
)


@pytest.mark.parametrize("user_value", [None, "mine"])
def test_a_command_job_without_gpus_gets_ds_accelerator_cpu_unless_the_user_set_it(
    tmp_path: Path, user_value: str | None
) -> None:
    show = "command=python3,-c,import os; print('DS_ACCELERATOR=' + os.environ['DS_ACCELERATOR'])"  # no comma: --set splits
    sets = ["--set", "resources.tasks_per_node=1", "--set", show]
    if user_value is not None:
        sets += ["--set", f"env.DS_ACCELERATOR={user_value}"]
    out = meshrun(tmp_path, "submit", "examples/command.yaml", "-c", "local", *sets, "--wait", check=True)
    _, run_dir = submitted(out)
    log = (run_dir / "logs" / "rank-0.log").read_text()
    assert f"DS_ACCELERATOR={user_value or 'cpu'}\n" in log, log


@needs_deepspeed
def test_deepspeed_script_trains_as_a_command_job_on_local(tmp_path: Path) -> None:
    # As shipped: on `local` the ranks run in the project's folder (examples/deepspeed_train.py resolves, as in
    # the code snapshot on Slurm) and the command's `python3` is meshrun's own environment's (no PATH given).
    command = f"command=python3,examples/deepspeed_train.py,--steps,{STEPS},--zero,2"
    out = meshrun(tmp_path, "submit", SPEC, "-c", "local", "--set", command, "--wait", timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    job_id, run_dir = submitted(out)
    assert f"job {job_id} COMPLETED" in out.stdout
    check_trained(run_dir, 2)


@needs_deepspeed
def test_deepspeed_script_trains_as_a_command_job_on_the_slurm_testbed(testbed: dict, tmp_path: Path) -> None:
    # The example as shipped: on Slurm the ranks run in the code snapshot, where its relative path holds.
    # One rank on each node: init_distributed() rendezvouses across "nodes" through MASTER_ADDR/PORT.
    sets = ["--set", "resources.nodes=2", "--set", "resources.tasks_per_node=1", "--set"]
    command = f"command=python3,examples/deepspeed_train.py,--steps,{STEPS},--zero,2"
    out = meshrun(tmp_path, "submit", SPEC, "-c", "testbed", *sets, command, "--wait", timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    job_id, run_dir = submitted(out)
    assert f"job {job_id} COMPLETED" in out.stdout
    check_trained(run_dir, 2)
