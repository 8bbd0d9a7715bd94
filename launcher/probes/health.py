"""A node's health check before the ranks start, on Slurm (the health gate): one task per node.

    python -m meshrun.launcher.probes.health RUN_DIR REFERENCE_TIME

Each node answers in RUN_DIR/health/NODE.json ({"node", "time", "seconds", "checks": [{"name", "verdict",
"evidence"}]}; seconds: how long its checks took):
- gpus: the GPUs the job asked for are there (NVML) and none reports a fault that a restart will not fix:
  uncorrectable ECC errors since the driver loaded, retired pages or remapped rows waiting for a reset, a
  failed row remapping, clocks held down by the hardware (slowdown, thermal, power brake);
- space: free space on the checkpoint root and on the node's scratch, for two checkpoints of the model (the
  spec's `resilience.min_free_gb` when given);
- storage: the checkpoint root takes a written, fsynced file (the run dir took the answer itself);
- python: the ranks' interpreter has torch, and on a GPU job imports it and sees the GPUs (a built-in trainer
  job; a `command:` job brings its own imports);
- clock: this node's time within CLOCK_SKEW_S of the batch host's (REFERENCE_TIME, its epoch seconds as the
  check started): checkpoints, heartbeats and the hang watchdog compare times across nodes.
A check that cannot run is the node's finding, not a crash: the program always exits 0 and launcher/batch/gate.py
judges the answers (a node with no answer fails). `meshrun doctor` runs the same checks on each node
(launcher/probes/doctor.py), so a preflight and the gate cannot disagree.

Fault injection for tests and drills (in the style of launcher/testing/faults.py; read by nothing else):

    MESHRUN_TEST_HEALTH_FAIL=NODE[,NODE]   those nodes' gpus check fails (an injected uncorrectable ECC error)
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, Optional, Sequence

from meshrun.launcher.contract.private import make_private_dir
from meshrun.launcher.contract.records.rundir import RunDir, expand_node_path, node_name, write_json
from meshrun.launcher.contract.spec.job import RunSpec, read_run_spec
from meshrun.launcher.contract.spec.modelshape import checkpoint_space_needed

Verdict = Literal["pass", "fail", "skip"]
FAIL_ENV = "MESHRUN_TEST_HEALTH_FAIL"
CLOCK_SKEW_S = 60.0
"""A node whose clock is this far from the batch host's fails (srun's start-up on a busy cluster takes
seconds, a clock without NTP drifts minutes)."""
HARDWARE_SLOWDOWN = 0x8 | 0x40 | 0x80
"""NVML's throttle reasons that only the hardware sets (HW slowdown, HW thermal slowdown, HW power brake): a
GPU held down by one before any work runs makes every step of the job wait for it."""
GB = 1e9


@dataclass(frozen=True)
class Check:
    name: str
    verdict: Verdict
    evidence: str = ""


def injected(node: str, environ: Mapping[str, str]) -> bool:
    return node in {n.strip() for n in environ.get(FAIL_ENV, "").split(",") if n.strip()}


# ------------------------------------------------------------------ GPUs


def gpu_faults(nvml: Any, handle: Any) -> list[str]:
    """What NVML reports wrong with one GPU that a restart of the job does not cure (each call the GPU or
    driver does not support is skipped)."""
    faults: list[str] = []

    def read(call: Callable[[], Any]) -> Any:
        try:
            return call()
        except nvml.NVMLError:
            return None

    ecc = read(
        lambda: nvml.nvmlDeviceGetTotalEccErrors(
            handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC
        )
    )
    if ecc:
        faults.append(f"{ecc} uncorrectable ECC errors since the driver loaded")
    if read(lambda: nvml.nvmlDeviceGetRetiredPagesPendingStatus(handle)):
        faults.append("retired pages pending (the GPU needs a reset)")
    reasons = read(lambda: nvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle))
    if isinstance(reasons, int) and reasons & HARDWARE_SLOWDOWN:
        faults.append(
            f"clocks held down by the hardware (throttle reasons {reasons:#x}: slowdown, thermal or power brake)"
        )
    rows = read(lambda: nvml.nvmlDeviceGetRemappedRows(handle))
    if rows is not None and len(rows) >= 4:
        if rows[3]:
            faults.append("row remapping failed")
        elif rows[2]:
            faults.append("remapped rows pending (the GPU needs a reset)")
    return faults


def check_gpus(expected: int, visible: Optional[str], broken: bool) -> Check:
    """The job's GPUs on this node: as many as asked, none with a lasting fault."""
    if broken:
        return Check("gpus", "fail", f"{FAIL_ENV}: 1 uncorrectable ECC error since the driver loaded (injected fault)")
    if expected == 0:
        return Check("gpus", "skip", "CPU job")
    from meshrun.launcher.sidecar.nvml import NvmlUnavailable, discover, load_nvml, resolve

    try:
        nvml = load_nvml()
    except NvmlUnavailable as exc:
        return Check("gpus", "fail", f"{expected} GPUs asked for, but {exc}")
    try:
        entries = tuple(e.strip() for e in visible.split(",") if e.strip()) if visible is not None else None
        targets, problems = resolve(entries, discover(nvml), expected)
        if len(targets) < expected:
            why = f"; {problems[0]}" if problems else ""
            return Check("gpus", "fail", f"{len(targets)} of the {expected} GPUs asked for are visible{why}")
        faults = [f"{t.uuid}: {fault}" for t in targets for fault in gpu_faults(nvml, t.device.handle)]
        if faults:
            return Check("gpus", "fail", "; ".join(faults))
        return Check("gpus", "pass", f"{len(targets)} x {targets[0].device.name}")
    finally:
        nvml.nvmlShutdown()


# ------------------------------------------------------------------ storage, space, python, clock


def needed_bytes(run_spec: RunSpec) -> int:
    """Free space a node needs per folder: the spec's min_free_gb, else two checkpoints of the model."""
    return checkpoint_space_needed(run_spec.job)


def check_space(folders: Sequence[str], need: int) -> Check:
    """Each folder's file system has `need` bytes free (the nearest existing parent is measured)."""
    low = []
    for folder in folders:
        probe = Path(folder)
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        free = shutil.disk_usage(probe).free
        if free < need:
            low.append(f"{folder}: {free / GB:.1f} GB free, {need / GB:.1f} GB needed")
    if low:
        return Check("space", "fail", "; ".join(low) + " (free space, or set resilience.min_free_gb)")
    return Check("space", "pass", f"{need / GB:.1f} GB free or more in {len(folders)} folders")


def check_storage(folder: str, node: str) -> Check:
    """A small file written, fsynced and removed in `folder` (the checkpoint root, shared storage)."""
    path = os.path.join(folder, f".health-{node}-{os.getpid()}")
    try:
        make_private_dir(folder)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, os.urandom(1 << 16))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.unlink(path)
    except OSError as exc:
        return Check("storage", "fail", f"{folder}: {type(exc).__name__}: {exc.strerror or exc}")
    return Check("storage", "pass", f"{folder} writable")


def check_python(trainer: bool, gpus: int) -> Check:
    """The ranks' interpreter has torch: on a GPU job it imports it and sees the node's GPUs (broken CUDA
    libraries or a driver mismatch show there); on a CPU job finding it suffices (its import cannot depend on
    the node's drivers, and importing it costs seconds of CPU on every node of every start)."""
    if not trainer:
        return Check("python", "skip", "a command job brings its own imports")
    if gpus == 0:
        import importlib.util

        found = importlib.util.find_spec("torch")
        if found is None:
            return Check("python", "fail", f"{sys.executable} has no torch")
        return Check("python", "pass", f"torch at {os.path.dirname(found.origin or '?')}")
    try:
        import torch

        seen = torch.cuda.device_count()
    except Exception as exc:  # any import failure is this node's finding
        return Check("python", "fail", f"{sys.executable} cannot import torch: {type(exc).__name__}: {exc}")
    if seen < gpus:
        return Check("python", "fail", f"torch {torch.__version__} sees {seen} of the {gpus} GPUs asked for")
    return Check("python", "pass", f"torch {torch.__version__}, {seen} GPUs")


def check_clock(reference: float, now: float) -> Check:
    skew = now - reference
    if abs(skew) > CLOCK_SKEW_S:
        return Check("clock", "fail", f"{skew:+.0f} s from the batch host's clock (at most {CLOCK_SKEW_S:g} s)")
    return Check("clock", "pass", f"{skew:+.1f} s from the batch host's clock")


# ------------------------------------------------------------------ the program


def node_checks(run_spec: RunSpec, node: str, environ: Mapping[str, str], reference: Optional[float]) -> list[Check]:
    """Every check of this node (the doctor runs them too, without a reference clock)."""
    job = run_spec.job
    ckpt = run_spec.run.checkpoint_dir or RunDir(run_spec.run.run_dir).default_checkpoints
    scratch = expand_node_path(run_spec.run.scratch_dir)
    checks = [
        check_gpus(job.resources.gpus_per_node, environ.get("CUDA_VISIBLE_DEVICES"), injected(node, environ)),
        check_space([ckpt, *([scratch] if scratch else [])], needed_bytes(run_spec)),
        check_storage(ckpt, node),
        check_python(job.command is None, job.resources.gpus_per_node),
    ]
    if reference is not None:
        checks.append(check_clock(reference, time.time()))
    return checks


def run(argv: Sequence[str], environ: Mapping[str, str]) -> int:
    run_dir, reference = argv[0], float(argv[1])
    node, began = node_name(environ), time.perf_counter()
    try:
        checks = node_checks(read_run_spec(Path(run_dir)), node, environ, reference)
    except Exception as exc:  # the spec or a check itself broke: still this node's answer
        checks = [Check("setup", "fail", f"{type(exc).__name__}: {exc}")]
    seconds = round(time.perf_counter() - began, 3)
    answer = {"node": node, "time": time.time(), "seconds": seconds, "checks": [asdict(c) for c in checks]}
    make_private_dir(os.path.dirname(RunDir(run_dir).health_result(node)))
    write_json(RunDir(run_dir).health_result(node), answer, indent=1)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print("usage: python -m meshrun.launcher.probes.health RUN_DIR REFERENCE_TIME", file=sys.stderr)
        sys.exit(2)
    sys.exit(run(sys.argv[1:], os.environ))
