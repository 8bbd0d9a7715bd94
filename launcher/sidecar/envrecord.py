"""The environment record: each node's hostname, GPUs, driver, CUDA, torch, NCCL and meshrun versions,
written to RUN_DIR/env/NODE.json; env_mismatches() (launcher/contract/records/envcheck.py, shared with `meshrun status`)
names what differs between nodes. Torch-free:
versions come from package metadata, never from importing torch.
"""

from __future__ import annotations

import platform
import socket
import time
from typing import Any, Mapping, Optional

from meshrun.launcher.contract.records.envcheck import COMPARED, env_mismatches, read_records
from meshrun.launcher.contract.records.rundir import write_json

NCCL_DISTRIBUTIONS = ("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11")
"""The NCCL wheels torch's CUDA builds depend on; a torch with NCCL linked in has none (then omitted)."""


def package_version(*names: str) -> Optional[str]:
    """The first installed distribution's version among `names`, None when none is installed."""
    from importlib import metadata  # ~20 ms of imports: only when a record is built, not for every importer

    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def run_id(environ: Mapping[str, str]) -> str:
    """Which run of the job this is: records of an earlier run (a requeue, a resume) are not compared."""
    job = environ.get("SLURM_JOB_ID") or environ.get("MESHRUN_JOB_ID") or "-"
    return f"{job}.{environ.get('SLURM_RESTART_COUNT', '0')}"


def build_record(node: str, environ: Mapping[str, str], gpus: Optional[Mapping[str, Any]]) -> dict[str, Any]:
    """This node's record; `gpus` is Gpus.describe() (None without NVML)."""
    from meshrun.launcher import installed_version

    described = dict(gpus or {})
    return {
        "node": node,
        "hostname": socket.gethostname(),
        "run": run_id(environ),
        "time": round(time.time(), 3),
        "driver": described.get("driver"),
        "cuda": described.get("cuda"),
        "gpus": described.get("gpus", []),
        "torch": package_version("torch"),
        "nccl": package_version(*NCCL_DISTRIBUTIONS),
        "meshrun": installed_version(),
        "python": platform.python_version(),
        "cuda_visible_devices": environ.get("CUDA_VISIBLE_DEVICES"),
    }


def write_record(path: str, record: Mapping[str, Any]) -> None:
    """Atomically (readers on other nodes may look at any moment)."""
    write_json(path, record, indent=1)


__all__ = ["COMPARED", "NCCL_DISTRIBUTIONS", "build_record", "env_mismatches", "read_records", "write_record"]
