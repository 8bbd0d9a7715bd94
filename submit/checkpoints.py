"""`meshrun resume` and `meshrun export`: continuing a job, and getting its weights out.

resume starts the job's own script again in the same run dir (a new Slurm job, or a
new local supervisor); the ranks find the newest complete checkpoint themselves. It
also clears the crash-loop guard's count: a person deciding to go on is new evidence.
export runs `python -m launcher.export` where the checkpoint is (this machine for a
local transport; the login node over SSH, then downloads the file).
"""
from __future__ import annotations

import dataclasses
import json
import shlex
import sys
from pathlib import Path
from typing import Any, Callable, Optional

from submit import local, slurm
from submit.errors import ClusterError, InputError
from submit.registry import JobRecord, Registry, now
from submit.render import SCRIPT_NAMES
from submit.transport import Transport

ATTEMPTS_FILE = "resume-attempts.json"  # launcher.resume.ATTEMPTS_FILE (that module imports torch-free ckpt code)


def run_spec_of(record: JobRecord, transport: Transport) -> dict[str, Any]:
    """The run dir's spec.json, as plain data."""
    raw = transport.read_bytes(f"{record.run_dir}/spec.json", 0, 1 << 22)
    if not raw:
        raise ClusterError(f"{record.run_dir}/spec.json is missing: the run dir of job {record.job_id} is gone")
    return json.loads(raw)


def checkpoint_dir(record: JobRecord, transport: Transport) -> str:
    run = run_spec_of(record, transport)["run"]
    return run.get("checkpoint_dir") or f"{record.run_dir}/checkpoints"


def resume(record: JobRecord, transport: Transport, registry: Registry, is_done: bool) -> JobRecord:
    """Start the stopped/failed/killed job again in its run dir; returns the new job's record."""
    if "_" in record.job_id:
        raise InputError("JOB", record.job_id, "resume a whole sweep task by resubmitting it; array tasks "
                                               "cannot be restarted one by one")
    if not is_done:
        raise InputError("JOB", record.job_id, "the job is still queued or running; cancel it first or wait")
    transport.run(["rm", "-f", "--", f"{checkpoint_dir(record, transport)}/{ATTEMPTS_FILE}"]).check("rm")
    script = f"{record.run_dir}/{SCRIPT_NAMES[record.scheduler]}"
    if record.scheduler == "local":
        job_id = local.new_job_id()
        local.reset_state(Path(record.run_dir))
        local.start(Path(record.run_dir), Path(script), job_id)
    else:
        argv = slurm.sbatch_argv(script, record.name, record.run_dir, ())
        job_id = slurm.parse_sbatch(transport.run(argv, timeout=120).check("sbatch").stdout)
    new = dataclasses.replace(record, job_id=job_id, submitted_at=now(), last_state="SUBMITTED")
    registry.add(new)
    return new


def code_dir(record: JobRecord, transport: Transport) -> Optional[str]:
    """The code snapshot the job ran with (its script exports MESHRUN_CODE_DIR), if any."""
    script = transport.read_bytes(f"{record.run_dir}/{SCRIPT_NAMES[record.scheduler]}", 0, 1 << 20).decode()
    for line in script.splitlines():
        if line.startswith("export MESHRUN_CODE_DIR="):
            return shlex.split(line.split("=", 1)[1])[0]
    return None


def _remote_script(setup: tuple[str, ...], python: str, argv: list[str], code: Optional[str]) -> str:
    """The cluster's setup lines (trusted, verbatim), then the export with every value quoted,
    with the job's code snapshot importable as it was for the ranks."""
    lines = list(setup)
    if code:
        lines.append(f'export PYTHONPATH={shlex.quote(code)}"${{PYTHONPATH:+:$PYTHONPATH}}"')
    return "\n".join([*lines, "exec " + shlex.join([python, *argv])])


def export(record: JobRecord, transport: Transport, profile: Any, out: Path, step: Optional[int],
           progress: Callable[[str], None] = lambda line: None) -> str:
    """Write consolidated safetensors weights to `out`; returns the checkpoint exported."""
    root = checkpoint_dir(record, transport)
    listing = transport.run(["ls", "-1", "--", root])
    steps = sorted(int(name[5:]) for name in listing.stdout.split()
                   if name.startswith("step-") and name[5:].isdigit()) if listing.returncode == 0 else []
    chosen = step if step is not None else (steps[-1] if steps else None)
    if chosen is None:
        raise ClusterError(f"job {record.job_id} has no checkpoint under {root} yet")
    ckpt = f"{root}/step-{chosen:08d}"
    args = ["-m", "launcher.export", ckpt]
    if profile.ssh is None:
        done = transport.run([sys.executable, *args, str(out)], timeout=3600)
        done.check("export")
        return ckpt
    remote = f"{record.run_dir}/export-step-{chosen:08d}.safetensors"
    script = _remote_script(profile.setup, profile.python, [*args, remote], code_dir(record, transport))
    transport.run(["bash", "-c", script], timeout=3600).check("export on the cluster")
    _download(transport, remote, out, progress)
    return ckpt


def _download(transport: Transport, remote: str, out: Path, progress: Callable[[str], None]) -> None:
    size, offset = transport.size(remote), 0
    tmp = out.with_name(f".{out.name}.part")
    with open(tmp, "wb") as handle:
        while offset < size:
            chunk = transport.read_bytes(remote, offset, 8 << 20)
            if not chunk:
                raise ClusterError(f"download of {remote} stopped at {offset} of {size} bytes")
            handle.write(chunk)
            offset += len(chunk)
            progress(f"{offset / 1e6:.1f}/{size / 1e6:.1f} MB")
    tmp.replace(out)
