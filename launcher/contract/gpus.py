"""GPU types and their dense bf16 peaks: the one table MFU is measured against. Torch-free, stdlib only.

The cluster profile names a partition's GPU type (`partitions[].gpu_type`: h100, h200, ...);
the bench knows the device by its CUDA name ("NVIDIA H100 80GB HBM3"). Both are looked up here,
by the longest table key the name contains, so "gh200" is never taken for "h200".
"""

from __future__ import annotations

from typing import Optional

PEAK_BF16_TFLOPS = {
    "a100": 312.0,
    "h100": 989.0,
    "h200": 989.0,
    "gh200": 989.0,
    "b200": 2250.0,
    "l40s": 362.0,
}
"""Dense (no sparsity) bf16 TFLOP/s of one GPU, from the SXM datasheets."""


MEMORY_BANDWIDTH_GBS = {
    "a100": 2039.0,
    "h100": 3350.0,
    "h200": 4800.0,
    "gh200": 4900.0,
    "b200": 8000.0,
    "l40s": 864.0,
}
"""HBM bandwidth of one GPU in GB/s (10^9 bytes/s), from the same datasheets (A100: the 80 GB SXM)."""

MEMORY_GB = {
    "a100": 80.0,
    "h100": 80.0,
    "h200": 141.0,
    "gh200": 144.0,
    "b200": 180.0,
    "l40s": 48.0,
}
"""Memory of one GPU, the datasheet's figure as profiles write gpu_memory_gb (the planner's fallback when a
partition sets none)."""

FP32_FRACTION = 67.0 / 989.0
"""fp32 matmuls (no TF32: torch's default) run at about this fraction of the bf16 tensor peak (H100 SXM)."""


def _lookup(table: dict[str, float], name: str) -> Optional[float]:
    """The entry of the longest table key that `name` contains ("gh200" is never taken for "h200")."""
    lowered = name.lower()
    for key in sorted(table, key=len, reverse=True):
        if key in lowered:
            return table[key]
    return None


def peak_tflops(name: str) -> Optional[float]:
    """The dense bf16 peak of a GPU type or device name, None when the table does not know it."""
    return _lookup(PEAK_BF16_TFLOPS, name)


def memory_bandwidth_gbs(name: str) -> Optional[float]:
    """HBM bandwidth (GB/s) of a GPU type or device name, None when the table does not know it."""
    return _lookup(MEMORY_BANDWIDTH_GBS, name)


def memory_gb(name: str) -> Optional[float]:
    """Memory (GB) of a GPU type or device name, None when the table does not know it."""
    return _lookup(MEMORY_GB, name)


def mfu(tflops_per_rank: float, peak: float) -> float:
    """Model FLOPs utilisation: the model FLOPs one rank achieves per second over its GPU's peak."""
    return tflops_per_rank / peak


def mfu_peak(gpu_type: str, cuda: bool, device_name: str = "") -> tuple[Optional[float], str]:
    """(peak TFLOP/s to measure MFU against, "") or (None, why there is no MFU, for the log).

    The profile's GPU type comes first (it is what the job asked for); a profile that names
    none falls back to the device's own CUDA name.
    """
    if not cuda:
        return None, "the ranks compute on the CPU (MFU is measured against a GPU's peak)"
    for name in (gpu_type, device_name):
        peak = peak_tflops(name) if name else None
        if peak:
            return peak, ""
    return None, (
        f"no dense bf16 peak known for GPU type {gpu_type or '(none in the profile)'!r} / device "
        f"{device_name!r}; add it to PEAK_BF16_TFLOPS in launcher/contract/gpus.py"
    )
