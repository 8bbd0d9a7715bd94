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
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Literal, Mapping, Optional, Sequence

from meshrun.launcher.contract.records.rundir import write_json
from meshrun.launcher.contract.spec.job import Model
from meshrun.launcher.contract.spec.modelshape import layer_elements, layer_flops_per_token
from meshrun.submit.folders import state_dir

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
    layer_overhead_us: Optional[float] = None
    """What one GPT block's forward and backward cost per micro-batch however small: on CPU ranks besides its
    matmuls and element-wise work (Python, autograd, dispatch; `layer_terms`), on GPUs launching its kernels
    (`gpu_block_terms`); microseconds."""
    layer_element_ns: Optional[float] = None
    """CPU ranks: the block's element-wise work, nanoseconds per value (`modelshape.layer_elements`)."""
    node_cpus: Optional[int] = None
    """CPU ranks: the CPUs of a node (the smallest any rank saw): a job with more ranks than that per node is
    bound by them."""
    block_efficiency: Optional[float] = None
    """GPUs: the share of the GEMM's rate a GPT block's forward and backward reach in bf16 (attention, norms and
    activations between the matmuls; `gpu_block_terms`); None: not timed (the planner's GEMM_EFFICIENCY)."""

    @property
    def date(self) -> str:
        return self.measured_at[:10]


def calibration_file(cluster: str) -> Path:
    return state_dir() / "calibration" / f"{cluster}.json"


def _median(values: Sequence[float]) -> Optional[float]:
    import statistics  # here: it (with decimal, fractions) cost ~1.5 ms of every `render`, which only loads records

    return round(statistics.median(values), 6) if values else None


def _figures(results: Sequence[Optional[Mapping[str, Any]]], part: str, key: str) -> list[float]:
    out = []
    for res in results:
        section = (res or {}).get(part)
        if isinstance(section, Mapping) and isinstance(section.get(key), (int, float)):
            out.append(float(section[key]))
    return out


def _layer_times(results: Sequence[Optional[Mapping[str, Any]]]) -> dict[tuple[int, int, int, int], float]:
    """The probe's per-block seconds (launcher/probes/doctor.py layer_seconds), median over the ranks per shape."""
    import statistics

    found: dict[tuple[int, int, int, int], list[float]] = {}
    for res in results:
        layers = ((res or {}).get("compute") or {}).get("layers")
        for row in layers if isinstance(layers, list) else ():
            try:
                key = (int(row["d_model"]), int(row["n_heads"]), int(row["seq_len"]), int(row["micro_batch"]))
                found.setdefault(key, []).append(float(row["seconds"]))
            except (KeyError, TypeError, ValueError):
                continue
    return {key: statistics.median(times) for key, times in found.items()}


def layer_terms(
    results: Sequence[Optional[Mapping[str, Any]]], gemm_tflops: float
) -> tuple[Optional[float], Optional[float]]:
    """(overhead_us, element_ns) of a CPU rank's GPT block: from the block timed at two shapes, each time less its
    matmuls at the measured GEMM rate = overhead + element_ns x its values (two equations, two unknowns; neither
    below 0). (None, None) without two shapes timed."""
    times = sorted(_layer_times(results).items(), key=lambda item: layer_elements(_model(item[0]), item[0][3]))
    if len(times) < 2 or gemm_tflops <= 0:
        return None, None
    (small, t_small), (large, t_large) = times[0], times[-1]

    def rest(shape: tuple[int, int, int, int], seconds: float) -> tuple[int, float]:
        cfg = _model(shape)
        tokens = cfg.seq_len * shape[3]
        return layer_elements(cfg, shape[3]), seconds - layer_flops_per_token(cfg) * tokens / (gemm_tflops * 1e12)

    (e_small, y_small), (e_large, y_large) = rest(small, t_small), rest(large, t_large)
    if e_large <= e_small:
        return None, None
    element_s = max((y_large - y_small) / (e_large - e_small), 0.0)
    overhead_s = max(y_small - element_s * e_small, 0.0)
    return round(overhead_s * 1e6, 3), round(element_s * 1e9, 4)


def gpu_block_terms(
    results: Sequence[Optional[Mapping[str, Any]]], gemm_tflops: float
) -> tuple[Optional[float], Optional[float]]:
    """(overhead_us, efficiency) of a GPU's GPT block, from the block timed at two shapes: each time = a fixed cost
    (launching its kernels) + its FLOPs at `efficiency` x the GEMM's rate (two equations, two unknowns; the share
    kept within 0.05-1). (None, None) without two shapes of different FLOPs timed."""
    times = sorted(_layer_times(results).items(), key=lambda item: _block_flops(item[0]))
    if len(times) < 2 or gemm_tflops <= 0:
        return None, None
    (small, t_small), (large, t_large) = times[0], times[-1]
    at_gemm = [_block_flops(shape) / (gemm_tflops * 1e12) for shape in (small, large)]
    if at_gemm[1] <= at_gemm[0] or t_large <= t_small:
        return None, None
    efficiency = min(max((at_gemm[1] - at_gemm[0]) / (t_large - t_small), 0.05), 1.0)
    overhead_s = max(t_small - at_gemm[0] / efficiency, 0.0)
    return round(overhead_s * 1e6, 3), round(efficiency, 4)


def _block_flops(shape: tuple[int, int, int, int]) -> int:
    """Training FLOPs of one block's forward and backward over one micro-batch of `shape`."""
    return layer_flops_per_token(_model(shape)) * shape[2] * shape[3]


def _model(shape: tuple[int, int, int, int]) -> Model:
    d_model, n_heads, seq_len, _ = shape
    return Model(n_layers=1, d_model=d_model, n_heads=n_heads, vocab_size=256, seq_len=seq_len)


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
    gemm_rate = _median(gemm) or 0.0
    element_ns = efficiency = None
    if device == "cpu":
        overhead_us, element_ns = layer_terms(results, gemm_rate)
    else:
        overhead_us, efficiency = gpu_block_terms(results, gemm_rate)
    return Calibration(
        measured_at=when.strftime("%Y-%m-%dT%H:%M:%SZ"),
        job=job,
        kind="cpu" if device == "cpu" else "gpu",
        device=device,
        nodes=nodes,
        ranks=sum(1 for r in results if r),
        gemm_tflops=gemm_rate,
        intra_node_busbw_gbps=_median(_figures(results, "comm", "intra_node_busbw_gbps")),
        inter_node_busbw_gbps=min(inter) if inter and nodes > 1 else None,
        storage_write_mbps=_median(writes),
        allreduce_latency_us=_median(_figures(results, "comm", "intra_node_latency_us")),
        layer_overhead_us=overhead_us,
        layer_element_ns=element_ns,
        node_cpus=int(min(cpus)) if (cpus := _figures(results, "compute", "node_cpus")) else None,
        block_efficiency=efficiency,
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
