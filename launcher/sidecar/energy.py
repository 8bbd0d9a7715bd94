"""The node's energy counters, read by its sidecar for launcher/contract/records/energy.py: NVML's total energy of each of
the job's GPUs, and RAPL's of each CPU package where this user may read it (since 2020 most kernels make
`energy_uj` root-only). A counter that cannot be read at the start is not measured at all: no partial sums."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

RAPL_ROOT = "/sys/class/powercap"


@dataclass
class Counter:
    """A rising energy counter read in `unit` joules, which wraps at `wrap` (RAPL's max_energy_range_uj; None:
    never); `used` is what it counted since the first read."""

    read: Callable[[], Optional[float]]
    unit: float
    wrap: Optional[float] = None
    last: Optional[float] = None
    used: float = 0.0

    def advance(self) -> Optional[float]:
        """Joules since the first read; None when the counter cannot be read now."""
        now = self.read()
        if now is None:
            return None
        if self.last is not None:
            delta = now - self.last
            self.used += delta if delta >= 0 else delta + (self.wrap or 0.0)
        self.last = now
        return self.used * self.unit


def _file_number(path: str) -> Callable[[], Optional[float]]:
    def read() -> Optional[float]:
        try:
            with open(path, encoding="ascii") as handle:
                return float(handle.read().strip())
        except (OSError, ValueError):
            return None

    return read


def rapl_packages(root: str = RAPL_ROOT) -> list[Counter]:
    """One counter per CPU package (intel-rapl:N; its sub-zones intel-rapl:N:M are parts of it) that reads now."""
    try:
        names = sorted(n for n in os.listdir(root) if n.startswith("intel-rapl:") and n.count(":") == 1)
    except OSError:
        return []
    found = []
    for name in names:
        zone = os.path.join(root, name)
        counter = Counter(
            _file_number(os.path.join(zone, "energy_uj")),
            1e-6,
            _file_number(os.path.join(zone, "max_energy_range_uj"))(),
        )
        if counter.advance() is not None:
            found.append(counter)
    return found


def nvml_gpus(nvml: Any, targets: list[Any]) -> list[Counter]:
    """One counter per GPU of the job (mJ since the driver loaded); [] where any of them has none (a MIG instance
    shares its GPU's counter, an older GPU has no counter): the node's GPU energy is then unmeasured."""
    counters = []
    for target in targets:
        if target.uuid != target.device.uuid:
            return []

        def read(handle: Any = target.device.handle) -> Optional[float]:
            try:
                return float(nvml.nvmlDeviceGetTotalEnergyConsumption(handle))
            except Exception:  # NVMLError_NotSupported and kin: no counter on this GPU
                return None

        counter = Counter(read, 1e-3)
        if counter.advance() is None:
            return []
        counters.append(counter)
    return counters


class EnergyMeter:
    """This node's share of the job's energy since the sidecar started."""

    def __init__(self, gpus: list[Counter], cpus: list[Counter]) -> None:
        self.gpus, self.cpus = gpus, cpus

    @staticmethod
    def _sum(counters: list[Counter]) -> Optional[float]:
        if not counters:
            return None
        values = [c.advance() for c in counters]
        return None if any(v is None for v in values) else sum(v for v in values if v is not None)

    def read(self) -> dict[str, Optional[float]]:
        """{"gpu_j", "cpu_j"}: joules since the start, None where unmeasured."""
        return {"gpu_j": self._sum(self.gpus), "cpu_j": self._sum(self.cpus)}
