"""What `meshrun doctor` measured on a cluster's partition, kept for `meshrun plan`: dated, private to the user.

    $XDG_STATE_HOME/meshrun/calibration/CLUSTER.json    {"PARTITION": {...a Calibration...}, ...}

`from_results` turns the doctor ranks' results into one Calibration: the typical rank's GEMM and in-node
all-reduce (the median: a slow node is the doctor's verdict to act on, not the cluster's speed), the slowest
cross-node all-reduce (every cross-node collective waits for it) and the median checkpoint write. `save`
records it for its partition, replacing the partition's earlier one; `load` reads it back. A partition's GPU
and CPU figures are kept apart (`kind`): a CPU doctor run on a GPU partition never stands for its GPUs.
Torch-free: the figures are plain numbers in the ranks' JSON.
"""

from __future__ import annotations

import datetime as _dt
import json
import statistics
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Literal, Mapping, Optional, Sequence

from launcher.contract.rundir import write_json
from submit.config.folders import state_dir

Kind = Literal["gpu", "cpu"]


@dataclass(frozen=True)
class Calibration:
    """One doctor run's figures for one partition."""

    measured_at: str
    """When (UTC, ISO 8601 to the second)."""
    job: str
    """The doctor job that measured them."""
    kind: Kind
    """What computed: the GPUs (bf16 GEMM, NCCL) or the CPU of a CPU job (fp32 GEMM, gloo)."""
    device: str
    """The GPU's name, or "cpu"."""
    nodes: int
    ranks: int
    gemm_tflops: Optional[float]
    """One rank's GEMM rate (median over the ranks), TFLOP/s."""
    intra_node_busbw_gbps: Optional[float]
    """All-reduce bus bandwidth inside a node (median over the ranks), GB/s."""
    inter_node_busbw_gbps: Optional[float]
    """All-reduce bus bandwidth across the nodes (the slowest rank's), GB/s; None on one node."""
    storage_write_mbps: Optional[float]
    """Checkpoint-dir write throughput (median over the nodes), MB/s."""
    allreduce_latency_us: Optional[float] = None
    """A tiny all-reduce inside a node (median over the ranks), microseconds: what every collective costs."""

    @property
    def date(self) -> str:
        return self.measured_at[:10]


def calibration_file(cluster: str) -> Path:
    return state_dir() / "calibration" / f"{cluster}.json"


def _median(values: Sequence[float]) -> Optional[float]:
    return round(statistics.median(values), 6) if values else None


def _figures(results: Sequence[Optional[Mapping[str, Any]]], part: str, key: str) -> list[float]:
    out = []
    for res in results:
        section = (res or {}).get(part)
        if isinstance(section, Mapping) and isinstance(section.get(key), (int, float)):
            out.append(float(section[key]))
    return out


def from_results(
    results: Sequence[Optional[Mapping[str, Any]]], job: str, nodes: int, now: Optional[_dt.datetime] = None
) -> Optional[Calibration]:
    """The figures of a doctor run's ranks (RUN_DIR/doctor/rank-N.json), or None when no rank measured a GEMM."""
    gemm = _figures(results, "compute", "tflops")
    if not gemm:
        return None
    device = next(str(r["compute"].get("device")) for r in results if r and "tflops" in r.get("compute", {}))
    writes = [
        float(r["storage"]["checkpoint"]["mbps"])
        for r in results
        if r and isinstance(r.get("storage"), Mapping) and "mbps" in (r["storage"].get("checkpoint") or {})
    ]
    inter = _figures(results, "comm", "inter_node_busbw_gbps")
    when = (now or _dt.datetime.now(_dt.timezone.utc)).astimezone(_dt.timezone.utc)
    return Calibration(
        measured_at=when.strftime("%Y-%m-%dT%H:%M:%SZ"),
        job=job,
        kind="cpu" if device == "cpu" else "gpu",
        device=device,
        nodes=nodes,
        ranks=sum(1 for r in results if r),
        gemm_tflops=_median(gemm),
        intra_node_busbw_gbps=_median(_figures(results, "comm", "intra_node_busbw_gbps")),
        inter_node_busbw_gbps=min(inter) if inter and nodes > 1 else None,
        storage_write_mbps=_median(writes),
        allreduce_latency_us=_median(_figures(results, "comm", "intra_node_latency_us")),
    )


def _key(partition: str, kind: Kind) -> str:
    return partition if kind == "gpu" else f"{partition}:cpu"


def load_all(cluster: str) -> dict[str, Calibration]:
    """Every calibration recorded for `cluster` (an unreadable or foreign file counts as none)."""
    try:
        data = json.loads(calibration_file(cluster).read_text())
    except (OSError, ValueError):
        return {}
    names = {f.name for f in fields(Calibration)}
    out = {}
    for key, value in data.items() if isinstance(data, dict) else ():
        if isinstance(value, dict) and set(value) <= names:  # a field added later has a default
            try:
                out[key] = Calibration(**value)
            except TypeError:  # a required field missing: not a record this version wrote
                continue
    return out


def load(cluster: str, partition: str, kind: Kind) -> Optional[Calibration]:
    """The newest calibration of `partition`'s GPUs (or, with kind "cpu", of its CPUs), if doctor measured one."""
    return load_all(cluster).get(_key(partition, kind))


def save(cluster: str, partition: str, calibration: Calibration) -> Path:
    """Record `calibration` for `partition` (0600 in a 0700 folder, whatever the umask); returns the file."""
    found = {key: asdict(c) for key, c in load_all(cluster).items()}
    found[_key(partition, calibration.kind)] = asdict(calibration)
    path = calibration_file(cluster)
    write_json(str(path), found, indent=1)
    return path
