"""What a job has used so far: GPU-hours (the GPUs Slurm's accounting says the allocation holds, else those the
spec asked for, times the allocated time), the energy its nodes measured (launcher/contract/records/energy.py: never a
guess) and, where the profile prices GPU-hours (cost.gpu_hour, carried in spec.json), what they cost. `meshrun
status JOB`, its --json and `meshrun top` show it; the sidecar's TensorBoard plots the same GPU-hours and cost."""

from __future__ import annotations

from typing import Any, Mapping, Optional


def usage(
    gpus: Optional[int],
    allocated_s: Optional[float],
    run_allocated_s: Optional[float],
    energy: Optional[Mapping[str, Any]],
    price: float,
    currency: str,
) -> dict[str, Any]:
    """{"gpus", "gpu_hours", "run_gpu_hours" (the run dir's jobs together; None with one job), "energy" ({"nodes",
    "gpu_kwh", "cpu_kwh"}, None where a node did not measure; None: no node recorded any), "cost"}."""
    hours = gpus * allocated_s / 3600 if gpus is not None and allocated_s is not None else None
    run_hours = gpus * run_allocated_s / 3600 if gpus is not None and run_allocated_s is not None else None
    return {
        "gpus": gpus,
        "gpu_hours": hours,
        "run_gpu_hours": run_hours,
        "energy": dict(energy) if energy is not None else None,
        "cost": {"amount": hours * price, "currency": currency} if price and hours is not None else None,
    }


def _kwh(value: Optional[float]) -> str:
    return f"{value:.3g} kWh" if value is not None else "unmeasured"


def _energy(energy: Mapping[str, Any]) -> str:
    return f", energy GPU {_kwh(energy.get('gpu_kwh'))}, CPU {_kwh(energy.get('cpu_kwh'))}"


def usage_line(used: Mapping[str, Any]) -> str:
    """'used: 3.2 GPU-hours (8 GPUs; the run dir's jobs 5.1), energy GPU 1.24 kWh, CPU unmeasured; cost 8.00 USD';
    a job without GPUs: 'used: no GPUs; energy not measured' (or its CPU energy where the nodes measured it)."""
    hours = used.get("gpu_hours")
    if used.get("gpus") == 0:  # a CPU job: neither its GPU-hours nor its GPU energy are figures worth a word
        cpu = (used.get("energy") or {}).get("cpu_kwh")
        return "used: no GPUs; " + ("energy not measured" if cpu is None else f"energy CPU {_kwh(cpu)}")
    if hours is None:
        head = "used: GPU-hours unknown"
    else:
        run = used.get("run_gpu_hours")
        head = f"used: {hours:.3g} GPU-hours ({used.get('gpus')} GPUs"
        head += f"; the run dir's jobs {run:.3g})" if run is not None else ")"
    energy = used.get("energy")
    head += ", energy unmeasured" if energy is None else _energy(energy)
    cost = used.get("cost")
    return head + (f"; cost {cost['amount']:.2f} {cost['currency']}" if cost else "")
