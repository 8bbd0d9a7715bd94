"""Host CPU, memory and disk I/O from /proc (Linux; no psutil). Torch-free.

Rates (CPU busy, disk MiB/s) are deltas between two readings, so the first reading is taken when
the sampler is made. Without /proc (a laptop on macOS) there is nothing to read: `available` is False.
"""

from __future__ import annotations

import os
import time
from typing import Any, Optional

MIN_WINDOW_S = 0.5
"""Rates over a shorter window (the first sample, at start) would mostly measure the sidecar's own start."""
SECTOR = 512
"""/proc/diskstats counts 512-byte sectors whatever the device's own sector size."""


def read_cpu(proc: str) -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot: idle and iowait are not busy."""
    with open(os.path.join(proc, "stat")) as handle:
        fields = [int(x) for x in handle.readline().split()[1:]]
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest is inside user)
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return total - idle, total


def read_memory(proc: str) -> tuple[int, int]:
    """(used, total) KiB: used is what is not available (MemTotal - MemAvailable)."""
    values: dict[str, int] = {}
    with open(os.path.join(proc, "meminfo")) as handle:
        for line in handle:
            key, _, rest = line.partition(":")
            if key in ("MemTotal", "MemAvailable"):
                values[key] = int(rest.split()[0])
    return values["MemTotal"] - values["MemAvailable"], values["MemTotal"]


def read_disks(proc: str, sys_block: str) -> tuple[int, int]:
    """(read, written) bytes since boot over whole disks (partitions would count twice; loop and
    RAM disks are not disks)."""
    try:
        disks = {name for name in os.listdir(sys_block) if not name.startswith(("loop", "ram", "zram"))}
    except OSError:
        disks = set()
    read = written = 0
    with open(os.path.join(proc, "diskstats")) as handle:
        for line in handle:
            fields = line.split()
            if len(fields) >= 10 and fields[2] in disks:
                read += int(fields[5]) * SECTOR
                written += int(fields[9]) * SECTOR
    return read, written


def read_load(proc: str) -> float:
    with open(os.path.join(proc, "loadavg")) as handle:
        return float(handle.read().split()[0])


class Host:
    """The node's CPU, memory and disk I/O, one line per sample."""

    def __init__(self, proc: str = "/proc", sys_block: str = "/sys/block") -> None:
        self.proc, self.sys_block = proc, sys_block
        self.available = os.path.exists(os.path.join(proc, "stat"))
        self.last: Optional[tuple[float, tuple[int, int], tuple[int, int]]] = None
        if self.available:
            self.last = (time.monotonic(), read_cpu(proc), read_disks(proc, sys_block))

    def sample(self) -> dict[str, Any]:
        """{cpu_pct, load1, mem_used_mib, mem_total_mib, disk_read_mib_s, disk_write_mib_s}."""
        if not self.available:
            return {}
        now, cpu, disks = time.monotonic(), read_cpu(self.proc), read_disks(self.proc, self.sys_block)
        used, total = read_memory(self.proc)
        row: dict[str, Any] = {
            "load1": read_load(self.proc),
            "mem_used_mib": used // 1024,
            "mem_total_mib": total // 1024,
        }
        if self.last is not None and now - self.last[0] >= MIN_WINDOW_S:
            then, last_cpu, last_disks = self.last
            ticks = cpu[1] - last_cpu[1]
            row["cpu_pct"] = round(100.0 * (cpu[0] - last_cpu[0]) / ticks, 1) if ticks > 0 else 0.0
            dt = max(now - then, 1e-6)
            row["disk_read_mib_s"] = round((disks[0] - last_disks[0]) / dt / 2**20, 3)
            row["disk_write_mib_s"] = round((disks[1] - last_disks[1]) / dt / 2**20, 3)
            self.last = (now, cpu, disks)
        elif self.last is None:
            self.last = (now, cpu, disks)
        return row
