"""GPU telemetry through NVML (nvidia-ml-py's `pynvml`), keyed by GPU UUID. Torch-free.

NVML numbers GPUs in its own order, which is not CUDA's: a sample is never keyed by a raw NVML
index. The job's GPUs are CUDA_VISIBLE_DEVICES (indexes, `GPU-` UUIDs or unique prefixes of
them, `MIG-` instance ids) resolved to UUIDs; an index counts the node's GPUs in PCI bus order,
which is CUDA's order under CUDA_DEVICE_ORDER=PCI_BUS_ID and on nodes of one GPU model. CUDA
device i of the job is local rank i's GPU (meshrun.launcher.train.runtime.gpu_index).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Optional

UINT_MAX = 0xFFFFFFFF
"""An NVLink field's scope id for the sum over every link."""
NVLINK_TX, NVLINK_RX = 138, 139
"""NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX / _RX: cumulative KiB of data over NVLink."""
THROTTLE_REASONS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal",
    0x40: "hw_thermal",
    0x80: "hw_power_brake",
    0x100: "display_clock",
}
"""nvmlClocksThrottleReason* bits, by name (what `throttle` lists in gpu.jsonl)."""

Log = Callable[[str], None]


class NvmlUnavailable(Exception):
    """No NVML here (no driver, a CPU node, a laptop): the sidecar records host metrics only."""


@dataclass(frozen=True)
class Device:
    """One physical GPU of the node as NVML sees it."""

    uuid: str
    pci_bus_id: str
    name: str
    handle: Any
    mig_uuids: tuple[str, ...] = ()


@dataclass(frozen=True)
class Target:
    """One GPU of this job: what each of its samples is keyed and tagged by."""

    uuid: str
    """The GPU's UUID (a MIG instance's own UUID when the job was given one)."""
    cuda_index: int
    """Its CUDA ordinal inside the job (its position in CUDA_VISIBLE_DEVICES)."""
    local_rank: Optional[int]
    """The local rank that uses it; None when the node runs fewer ranks than it has GPUs."""
    device: Device
    """The physical GPU (a MIG instance's parent) that is sampled."""


def _find(entry: str, devices: list[Device]) -> tuple[Optional[Device], str]:
    """The device an entry names, or (None, why not)."""
    if entry.isdigit():
        index = int(entry)
        if index < len(devices):
            return devices[index], ""
        return None, f"no GPU {index} on this node ({len(devices)} GPUs)"
    wanted = entry.upper()
    if wanted.startswith("MIG-"):
        hits = [d for d in devices if any(m.upper().startswith(wanted) for m in d.mig_uuids)]
    else:
        prefix = wanted if wanted.startswith("GPU-") else f"GPU-{wanted}"
        hits = [d for d in devices if d.uuid.upper().startswith(prefix)]
    if len(hits) == 1:
        return hits[0], ""
    return None, ("no GPU of this node has that UUID" if not hits else "that prefix names several GPUs")


def resolve(
    visible: Optional[tuple[str, ...]], devices: list[Device], tasks_per_node: int
) -> tuple[list[Target], list[str]]:
    """The job's GPUs from CUDA_VISIBLE_DEVICES (None: unset, every GPU), and one problem line per entry
    that names none. As CUDA does, the first entry naming no GPU ends the list."""
    entries = [str(i) for i in range(len(devices))] if visible is None else list(visible)
    targets: list[Target] = []
    problems: list[str] = []
    seen: set[str] = set()
    for position, entry in enumerate(entries):
        device, why = _find(entry, devices)
        if device is None:
            problems.append(
                f"CUDA_VISIBLE_DEVICES entry {entry!r}: {why}; it and the entries after it are not sampled "
                "(CUDA ignores them too)"
            )
            break
        uuid = device.uuid
        if entry.upper().startswith("MIG-"):
            uuid = next(m for m in device.mig_uuids if m.upper().startswith(entry.upper()))
        if uuid in seen:
            problems.append(f"CUDA_VISIBLE_DEVICES entry {entry!r} names {uuid} twice; sampled once")
            continue
        seen.add(uuid)
        local_rank = position if position < tasks_per_node else None
        targets.append(Target(uuid=uuid, cuda_index=position, local_rank=local_rank, device=device))
    return targets, problems


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _mig_uuids(nvml: Any, handle: Any) -> tuple[str, ...]:
    """The UUIDs of a GPU's MIG instances (none when MIG is off or unsupported)."""
    try:
        if nvml.nvmlDeviceGetMigMode(handle)[0] != 1:
            return ()
        count = nvml.nvmlDeviceGetMaxMigDeviceCount(handle)
    except nvml.NVMLError:
        return ()
    uuids = []
    for i in range(count):
        try:
            uuids.append(_text(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, i))))
        except nvml.NVMLError:
            continue  # an empty slot
    return tuple(uuids)


def discover(nvml: Any) -> list[Device]:
    """Every GPU of the node, in PCI bus order (NVML's own index order is not used as a key)."""
    devices = []
    for i in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(i)
        devices.append(
            Device(
                uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
                pci_bus_id=_text(nvml.nvmlDeviceGetPciInfo(handle).busId).lower(),
                name=_text(nvml.nvmlDeviceGetName(handle)),
                handle=handle,
                mig_uuids=_mig_uuids(nvml, handle),
            )
        )
    return sorted(devices, key=lambda d: d.pci_bus_id)


def load_nvml() -> Any:
    """pynvml, initialised; NvmlUnavailable (one line saying why) when there is no NVML here."""
    try:
        import pynvml
    except ImportError as exc:
        raise NvmlUnavailable(f"nvidia-ml-py is not installed ({exc})") from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise NvmlUnavailable(f"NVML cannot start: {exc}") from None
    return pynvml


class Gpus:
    """The job's GPUs on this node: one sample line per GPU per call, XID events included."""

    def __init__(self, nvml: Any, targets: list[Target], log: Log) -> None:
        self.nvml = nvml
        self.targets = targets
        self.log = log
        self.off: set[str] = set()
        """Metrics this node's driver does not give (asked once, then left out)."""
        self.failed: set[str] = set()
        """Metrics whose error was logged already (one line each, not one per sample)."""
        self.nvlink_last: dict[str, tuple[float, float, float]] = {}
        self.events = self._register_events()

    def _register_events(self) -> Any:
        """An NVML event set for XID errors on the job's GPUs; None where the driver gives none."""
        nvml = self.nvml
        try:
            events = nvml.nvmlEventSetCreate()
        except nvml.NVMLError as exc:
            self.log(f"XID events: not available here ({exc})")
            return None
        registered = 0
        for target in {t.device.uuid: t for t in self.targets}.values():
            try:
                nvml.nvmlDeviceRegisterEvents(target.device.handle, nvml.nvmlEventTypeXidCriticalError, events)
                registered += 1
            except nvml.NVMLError as exc:
                self.log(f"XID events: not available for {target.device.uuid} ({exc})")
        return events if registered else None

    def _read(self, metric: str, read: Callable[[], Any]) -> Any:
        """One NVML query; None when the driver does not give it (then never asked again) or it failed."""
        if metric in self.off:
            return None
        nvml = self.nvml
        try:
            return read()
        except nvml.NVMLError as exc:
            unsupported = (nvml.NVMLError_NotSupported, getattr(nvml, "NVMLError_NoPermission", ()))
            if isinstance(exc, unsupported):
                self.off.add(metric)
                self.log(f"{metric}: not given by this driver or GPU ({exc}); left out")
            elif metric not in self.failed:
                self.failed.add(metric)
                self.log(f"{metric}: NVML error {exc} (logged once; sampling goes on)")
            return None

    def xid_events(self) -> dict[str, list[int]]:
        """XID codes that arrived since the last call, by GPU UUID (the wait does not block)."""
        found: dict[str, list[int]] = {}
        if self.events is None:
            return found
        nvml = self.nvml
        for _ in range(1000):  # a storm must not stall the sampler: the rest waits for the next round
            try:
                data = nvml.nvmlEventSetWait_v2(self.events, 0)
            except nvml.NVMLError_Timeout:
                break
            except nvml.NVMLError as exc:
                self.log(f"XID events: reading failed ({exc}); no longer watched")
                self.events = None
                break
            try:
                uuid = _text(nvml.nvmlDeviceGetUUID(data.device))
            except nvml.NVMLError:
                uuid = "unknown"
            found.setdefault(uuid, []).append(int(data.eventData))
        return found

    def _nvlink(self, target: Target, now: float) -> tuple[Optional[float], Optional[float]]:
        """NVLink data KiB/s (tx, rx) since the last sample, summed over links."""
        nvml = self.nvml

        def read() -> tuple[float, float]:
            values = nvml.nvmlDeviceGetFieldValues(target.device.handle, [(NVLINK_TX, UINT_MAX), (NVLINK_RX, UINT_MAX)])
            if any(v.nvmlReturn != 0 for v in values):
                raise nvml.NVMLError_NotSupported(nvml.NVML_ERROR_NOT_SUPPORTED)
            return float(values[0].value.ullVal), float(values[1].value.ullVal)

        counters = self._read("nvlink_kib_s", read)
        if counters is None:
            return None, None
        last = self.nvlink_last.get(target.uuid)
        self.nvlink_last[target.uuid] = (now, *counters)
        if last is None or now <= last[0]:
            return None, None
        dt = now - last[0]
        return (counters[0] - last[1]) / dt, (counters[1] - last[2]) / dt

    def sample_one(self, target: Target, now: float) -> dict[str, Any]:
        """The metrics of one GPU (a key is left out where the driver gives none)."""
        nvml, handle = self.nvml, target.device.handle
        row: dict[str, Any] = {}
        util = self._read("util_pct", lambda: nvml.nvmlDeviceGetUtilizationRates(handle))
        if util is not None:
            row["util_pct"], row["mem_util_pct"] = util.gpu, util.memory
        memory = self._read("mem_used_mib", lambda: nvml.nvmlDeviceGetMemoryInfo(handle))
        if memory is not None:
            row["mem_used_mib"], row["mem_total_mib"] = memory.used // 2**20, memory.total // 2**20
        power = self._read("power_w", lambda: nvml.nvmlDeviceGetPowerUsage(handle))
        if power is not None:
            row["power_w"] = round(power / 1000, 1)
        temp = self._read("temp_c", lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU))
        if temp is not None:
            row["temp_c"] = temp
        clock = self._read("sm_clock_mhz", lambda: nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM))
        if clock is not None:
            row["sm_clock_mhz"] = clock
        # Renamed in NVML 12.2 (the bits are the same): the new name where the module has it.
        reasons = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
        reasons = reasons or nvml.nvmlDeviceGetCurrentClocksThrottleReasons
        mask = self._read("throttle", lambda: reasons(handle))
        if mask is not None:
            row["throttle"] = [name for bit, name in THROTTLE_REASONS.items() if mask & bit]
        for kind, key in (
            (nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, "ecc_corrected"),
            (nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, "ecc_uncorrected"),
        ):
            count = self._read(key, partial(nvml.nvmlDeviceGetTotalEccErrors, handle, kind, nvml.NVML_VOLATILE_ECC))
            if count is not None:
                row[key] = count
        for direction, key in (
            (nvml.NVML_PCIE_UTIL_TX_BYTES, "pcie_tx_kb_s"),
            (nvml.NVML_PCIE_UTIL_RX_BYTES, "pcie_rx_kb_s"),
        ):
            rate = self._read("pcie_kb_s", partial(nvml.nvmlDeviceGetPcieThroughput, handle, direction))
            if rate is not None:
                row[key] = rate
        tx, rx = self._nvlink(target, now)
        if tx is not None:
            row["nvlink_tx_kib_s"], row["nvlink_rx_kib_s"] = round(tx, 1), round(rx or 0.0, 1)
        return row

    def sample(self, now: Optional[float] = None) -> list[dict[str, Any]]:
        """One line per GPU of the job: {uuid, cuda_index, local_rank, ...metrics, xid?}."""
        now = time.time() if now is None else now
        xids = self.xid_events()
        rows = []
        for target in self.targets:
            row: dict[str, Any] = {"uuid": target.uuid, "cuda_index": target.cuda_index}
            row["local_rank"] = target.local_rank
            row.update(self.sample_one(target, now))
            codes = xids.get(target.device.uuid, []) + (
                xids.get(target.uuid, []) if target.uuid != target.device.uuid else []
            )
            if codes:
                row["xid"] = codes
                self.log(
                    f"XID {', '.join(map(str, codes))} on {target.uuid} (CUDA {target.cuda_index}, local rank {target.local_rank})"
                )
            rows.append(row)
        return rows

    def describe(self) -> dict[str, Any]:
        """What the environment record holds from NVML: driver, CUDA, and the job's GPUs."""
        nvml = self.nvml
        out: dict[str, Any] = {"driver": None, "cuda": None}
        try:
            out["driver"] = _text(nvml.nvmlSystemGetDriverVersion())
            version = int(nvml.nvmlSystemGetCudaDriverVersion_v2())
            out["cuda"] = f"{version // 1000}.{version % 1000 // 10}"
        except nvml.NVMLError as exc:
            self.log(f"driver/CUDA version: NVML error {exc}")
        out["gpus"] = [
            {
                "uuid": t.uuid,
                "model": t.device.name,
                "cuda_index": t.cuda_index,
                "local_rank": t.local_rank,
                "pci_bus_id": t.device.pci_bus_id,
            }
            for t in self.targets
        ]
        return out

    def close(self) -> None:
        try:
            if self.events is not None:
                self.nvml.nvmlEventSetFree(self.events)
            self.nvml.nvmlShutdown()
        except self.nvml.NVMLError:
            pass
