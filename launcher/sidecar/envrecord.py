"""The environment record: each node's hostname, GPUs, driver, CUDA, torch, NCCL and meshrun versions,
written to RUN_DIR/env/NODE.json; env_mismatches() names what differs between nodes. Torch-free:
versions come from package metadata, never from importing torch.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import time
from importlib import metadata
from typing import Any, Iterable, Mapping, Optional

COMPARED = ("driver", "cuda", "torch", "nccl", "meshrun", "python")
"""Versions that must agree between the nodes of one run (a mismatch is a warning)."""
NCCL_DISTRIBUTIONS = ("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11")
"""The NCCL wheels torch's CUDA builds depend on; a torch with NCCL linked in has none (then omitted)."""


def package_version(*names: str) -> Optional[str]:
    """The first installed distribution's version among `names`, None when none is installed."""
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
    from launcher import installed_version

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
    folder = os.path.dirname(path)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        json.dump(record, handle, indent=1, sort_keys=True)
    os.replace(tmp, path)


def read_records(folder: str, run: Optional[str] = None) -> list[dict[str, Any]]:
    """Every node's record in `folder` (RUN_DIR/env), only run `run`'s when given; unreadable ones skipped."""
    records = []
    try:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".json") and not n.startswith("."))
    except OSError:
        return []
    for name in names:
        try:
            with open(os.path.join(folder, name), encoding="utf-8") as handle:
                record = json.load(handle)
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and (run is None or record.get("run") == run):
            records.append(record)
    return records


def env_mismatches(records: Iterable[Mapping[str, Any]]) -> list[str]:
    """One line per version that differs between nodes, e.g.
    "driver differs between nodes: 550.54 on n1; 535.104 on n2". Pure; [] when all agree."""
    lines = []
    records = list(records)
    for key in COMPARED:
        nodes_by_value: dict[str, list[str]] = {}
        for record in records:
            value = record.get(key)
            if value is None:
                continue  # not known there (no NVML, no NCCL wheel): nothing to compare
            nodes_by_value.setdefault(str(value), []).append(str(record.get("node", "?")))
        if len(nodes_by_value) > 1:
            parts = "; ".join(
                f"{value} on {', '.join(sorted(nodes))}" for value, nodes in sorted(nodes_by_value.items())
            )
            lines.append(f"{key} differs between nodes: {parts}")
    return lines
