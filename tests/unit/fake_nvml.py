"""A fake `pynvml` for the sidecar's unit tests: the calls meshrun.launcher.sidecar.nvml makes, over fake GPUs.

NVML's index order is deliberately not PCI order here, so a test that keys by NVML index fails.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any, Optional

NVML_ERROR_NOT_SUPPORTED = 3


class NVMLError(Exception):
    def __init__(self, value: int = 999) -> None:
        super().__init__(value)
        self.value = value


class NVMLError_NotSupported(NVMLError):
    pass


class NVMLError_NoPermission(NVMLError):
    pass


class NVMLError_Timeout(NVMLError):
    pass


class NVMLError_LibraryNotFound(NVMLError):
    pass


class NVMLError_Unknown(NVMLError):
    pass


@dataclass
class FakeGpu:
    uuid: str
    bus: str
    name: str = "NVIDIA H200"
    util: int = 50
    used: int = 10 * 2**30
    total: int = 141 * 2**30
    power_mw: int = 400_000
    temp: int = 60
    sm_clock: int = 1980
    throttle: int = 0x4 | 0x40  # sw power cap + hw thermal
    ecc: tuple[int, int] = (3, 0)
    pcie: tuple[int, int] = (1000, 2000)
    nvlink_kib: list[float] = field(default_factory=lambda: [0.0, 0.0])
    migs: tuple[str, ...] = ()
    pages_pending: int = 0
    """Retired pages waiting for a reset (1) or not (0)."""
    rows: tuple[int, int, int, int] = (0, 0, 0, 0)
    """Remapped rows: corrected, uncorrected, pending, failure."""
    unsupported: set[str] = field(default_factory=set)
    """Functions that raise NotSupported for this GPU."""
    broken: set[str] = field(default_factory=set)
    """Functions that raise another NVMLError for this GPU."""


class Handle:
    def __init__(self, gpu: FakeGpu) -> None:
        self.gpu = gpu


def make(gpus: list[FakeGpu], init_error: Optional[type[NVMLError]] = None, events: bool = True) -> types.ModuleType:
    """A pynvml module over `gpus` (NVML's index order is the list's order)."""
    m = types.ModuleType("pynvml")
    for cls in (
        NVMLError,
        NVMLError_NotSupported,
        NVMLError_NoPermission,
        NVMLError_Timeout,
        NVMLError_LibraryNotFound,
    ):
        setattr(m, cls.__name__, cls)
    m.NVML_ERROR_NOT_SUPPORTED = NVML_ERROR_NOT_SUPPORTED
    m.NVML_TEMPERATURE_GPU, m.NVML_CLOCK_SM, m.NVML_VOLATILE_ECC = 0, 1, 0
    m.NVML_MEMORY_ERROR_TYPE_CORRECTED, m.NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 0, 1
    m.NVML_PCIE_UTIL_TX_BYTES, m.NVML_PCIE_UTIL_RX_BYTES = 0, 1
    m.nvmlEventTypeXidCriticalError = 8
    state: dict[str, Any] = {"pending": [], "shutdown": False, "registered": []}
    m.state = state
    handles = [Handle(g) for g in gpus]

    def call(name: str, handle: Handle, value: Any) -> Any:
        if name in handle.gpu.unsupported:
            raise NVMLError_NotSupported(NVML_ERROR_NOT_SUPPORTED)
        if name in handle.gpu.broken:
            raise NVMLError_Unknown(999)
        return value

    def init() -> None:
        if init_error is not None:
            raise init_error(9)

    m.nvmlInit = init
    m.nvmlShutdown = lambda: state.update(shutdown=True)
    m.nvmlDeviceGetCount = lambda: len(handles)
    m.nvmlDeviceGetHandleByIndex = lambda i: handles[i]
    m.nvmlDeviceGetUUID = lambda h: h.gpu.uuid.encode() if isinstance(h, Handle) else h
    m.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busId=h.gpu.bus.encode())
    m.nvmlDeviceGetName = lambda h: h.gpu.name
    m.nvmlDeviceGetMigMode = lambda h: (1, 1) if h.gpu.migs else (0, 0)
    m.nvmlDeviceGetMaxMigDeviceCount = lambda h: len(h.gpu.migs)
    m.nvmlDeviceGetMigDeviceHandleByIndex = lambda h, i: h.gpu.migs[i]  # a MIG "handle" is its uuid here
    m.nvmlDeviceGetUtilizationRates = lambda h: call(
        "util", h, types.SimpleNamespace(gpu=h.gpu.util, memory=h.gpu.util // 2)
    )
    m.nvmlDeviceGetMemoryInfo = lambda h: call("memory", h, types.SimpleNamespace(used=h.gpu.used, total=h.gpu.total))
    m.nvmlDeviceGetPowerUsage = lambda h: call("power", h, h.gpu.power_mw)
    m.nvmlDeviceGetTemperature = lambda h, sensor: call("temp", h, h.gpu.temp)
    m.nvmlDeviceGetClockInfo = lambda h, kind: call("clock", h, h.gpu.sm_clock)
    m.nvmlDeviceGetCurrentClocksThrottleReasons = lambda h: call("throttle", h, h.gpu.throttle)
    m.nvmlDeviceGetTotalEccErrors = lambda h, kind, counter: call("ecc", h, h.gpu.ecc[kind])
    m.nvmlDeviceGetPcieThroughput = lambda h, d: call("pcie", h, h.gpu.pcie[d])
    m.nvmlDeviceGetRetiredPagesPendingStatus = lambda h: call("pages", h, h.gpu.pages_pending)
    m.nvmlDeviceGetRemappedRows = lambda h: call("rows", h, h.gpu.rows)

    def field_values(h: Handle, ids: list[tuple[int, int]]) -> list[Any]:
        call("nvlink", h, None)
        return [
            types.SimpleNamespace(nvmlReturn=0, value=types.SimpleNamespace(ullVal=int(h.gpu.nvlink_kib[i])))
            for i, _ in enumerate(ids)
        ]

    m.nvmlDeviceGetFieldValues = field_values
    m.nvmlSystemGetDriverVersion = lambda: "550.54.15"
    m.nvmlSystemGetCudaDriverVersion_v2 = lambda: 12040

    def event_set_create() -> str:
        if not events:
            raise NVMLError_NotSupported(NVML_ERROR_NOT_SUPPORTED)
        return "event-set"

    def wait(event_set: str, timeout_ms: int) -> Any:
        if not state["pending"]:
            raise NVMLError_Timeout(10)
        uuid, xid = state["pending"].pop(0)
        handle = next(h for h in handles if h.gpu.uuid == uuid)
        return types.SimpleNamespace(device=handle, eventType=8, eventData=xid)

    m.nvmlEventSetCreate = event_set_create
    m.nvmlDeviceRegisterEvents = lambda h, types_, s: state["registered"].append(h.gpu.uuid)
    m.nvmlEventSetWait_v2 = wait
    m.nvmlEventSetFree = lambda s: None
    return m
