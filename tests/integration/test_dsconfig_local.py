"""The DeepSpeed config on the embedded `local` cluster through the real CLI: the run dir holds it, status shows
the engine (no training needed: the job's data path does not exist, so its ranks stop at once)."""

from __future__ import annotations

import json
from pathlib import Path

from meshrun.launcher.contract.spec import dsconfig
from meshrun.launcher.contract.spec.job import loads_run_spec
from tests.helpers.cli import TINY, meshrun, status, submitted


def test_submitted_deepspeed_job_has_its_config_in_the_run_dir_and_status_shows_the_engine(tmp_path: Path) -> None:
    overrides = ("train.engine=deepspeed", "parallel.zero=3", "parallel.offload_optimizer=true")
    sets = [arg for o in overrides for arg in ("--set", o)]
    out = meshrun(
        tmp_path, "submit", *TINY, *sets, "--set", "data.path=/nonexistent/tokens.u16", "--no-check", check=True
    )
    job_id, run_dir = submitted(out)
    try:
        spec = loads_run_spec((run_dir / "spec.json").read_text(), "spec.json").job
        assert json.loads((run_dir / "deepspeed.json").read_text()) == dsconfig.generate(spec)
        assert status(tmp_path, job_id)["engine"] == "deepspeed ZeRO-3, optimizer offload"
        shown = meshrun(tmp_path, "status", job_id, check=True).stdout
        assert "engine: deepspeed ZeRO-3, optimizer offload" in shown.splitlines(), shown
    finally:
        meshrun(tmp_path, "cancel", job_id)
