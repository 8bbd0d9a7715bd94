"""The sidecar's main loop: periodic tasks on one thread until SIGTERM or until its parent is gone.

A task is a name, an interval and a function. A task that raises is logged (its first error, then
every tenfold count) and runs again at its next turn: nothing here ever ends the job. Sampling and
the environment check, the hang watch (watchdog.py) and the checkpoint copier (copier.py) are tasks.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Union

from meshrun.launcher.contract import procs
from meshrun.launcher.contract.records import goodput, logtimes
from meshrun.launcher.contract.records.rundir import (
    RunDir,
    attempt_id,
    expand_node_path,
    job_field,
    job_of,
    note_checkpoint,
    read_state,
    write_json,
)
from meshrun.launcher.contract.spec.job import Alerts, Watchdog
from meshrun.launcher.sidecar import envrecord
from meshrun.launcher.sidecar.alerting import Alerting
from meshrun.launcher.sidecar.energy import EnergyMeter, nvml_gpus, rapl_packages
from meshrun.launcher.sidecar.host import Host
from meshrun.launcher.sidecar.keeper import SINCE_ENV
from meshrun.launcher.sidecar.nvml import Gpus, NvmlUnavailable, discover, load_nvml, resolve
from meshrun.launcher.sidecar.watchdog import Watchdog as HangWatch
from meshrun.launcher.train.tbwriter import scalars_of

if TYPE_CHECKING:
    from meshrun.launcher.sidecar.copier import Copier

DEFAULT_INTERVAL_S = 5.0
"""Sampling interval when spec.json cannot be read (the spec's own default is the same)."""
ENV_CHECK_S = 30.0
"""How often the other nodes' environment records are compared with this one's."""
STALE_BEAT_S = 5.0
"""Heartbeats older than the sidecar's start by more than this are an earlier attempt's."""
WATCH_S = 1.0
"""How often the hang watch reads the heartbeats and the copier looks for staged checkpoints."""
POLL_S = 1.0
"""The longest the loop sleeps between checks that its parent is still there."""
STAMP_S = 5.0
GOODPUT_S = 60.0
"""How often node 0's sidecar works out the job's goodput so far (`status JOB`, its TensorBoard files)."""
"""How often a sidecar of a multi-node job with scratch stamps RUN_DIR/.meshrun/sidecars/NODE_RANK.json."""
STAMP_STALE_S = 30.0
"""A stamp this old is a dead sidecar's (node rank 0 stops waiting for its parts at the end)."""
LogFn = Callable[[str], None]
"""Where one line goes (a Log; a list's append in tests)."""


@dataclass
class Periodic:
    """A task the loop runs every `interval_s` seconds (the first run at once)."""

    name: str
    interval_s: float
    run: Callable[[], None]
    next_at: float = 0.0
    errors: int = field(default=0)


def process_alive(pid: Any) -> bool:
    """Whether `pid` names a running process (a zombie, ended but not yet reaped, is not)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return procs.state(pid) not in procs.ENDED  # None (gone since, or unreadable): as alive as os.kill found it


def rank_alive(beat: dict[str, Any]) -> bool:
    """Whether the rank that wrote this heartbeat still runs: its pid, while it still names that process
    (its start time, meshrun.launcher.contract.procs; a heartbeat without one is judged by its pid alone)."""
    identity = procs.Identity.from_json(beat)
    return procs.alive(identity) if identity is not None else process_alive(beat.get("pid"))


class Flag:
    """A stop flag a signal handler may set: threading.Event.set() takes a lock, and a handler that runs
    while the main thread holds it (inside Event.wait) deadlocks the sidecar for good (seen on the testbed:
    after its USR2s, one from srun and one from its keeper, the sidecar's main thread sat in a futex and
    the batch script waited out sidecar_stop_s). wait() only sleeps: the loop reads the flag at least
    every POLL_S."""

    def __init__(self) -> None:
        self.value = False

    def set(self) -> None:
        self.value = True

    def is_set(self) -> bool:
        return self.value

    def wait(self, timeout: float) -> bool:
        if not self.value:
            time.sleep(timeout)
        return self.value


Stop = Union[threading.Event, Flag]


def run_tasks(tasks: list[Periodic], stop: Stop, alive: Callable[[], bool], log: LogFn) -> str:
    """Run the tasks until `stop` is set or `alive()` turns false; returns why it stopped."""
    while not stop.is_set():
        if not alive():
            return "its parent is gone"
        now = time.monotonic()
        for task in tasks:
            if now >= task.next_at and not stop.is_set():
                try:
                    task.run()
                except Exception as exc:
                    task.errors += 1
                    if task.errors in (1, 10, 100, 1000, 10000):
                        log(f"{task.name} failed ({task.errors}x so far): {type(exc).__name__}: {exc}")
                task.next_at = time.monotonic() + task.interval_s
        wake = min(task.next_at for task in tasks) - time.monotonic()
        stop.wait(min(max(wake, 0.0), POLL_S))
    return "stop requested"


@dataclass(frozen=True)
class Settings:
    """What the sidecar takes from spec.json and the Slurm environment."""

    interval_s: float = DEFAULT_INTERVAL_S
    tasks_per_node: int = 1
    node_rank: int = 0
    nodes: int = 1
    watchdog: Optional[Watchdog] = None
    """Hang and straggler detection settings; None when spec.json is unusable (no watchdog then)."""
    scratch_dir: str = ""
    """This run's node-local scratch ("" without: no staging, no copier)."""
    checkpoint_dir: str = ""
    keep: int = 3
    keep_every: int = 0
    final_copy_s: float = 0.0
    alerts: Alerts = field(default_factory=Alerts)
    """The GPU, straggler and hang rules' thresholds (launcher/sidecar/alerting.py)."""
    suspects_file: str = ""
    """The cluster's ledger of suspect nodes, where a hang verdict records the nodes it blames ("": none)."""
    gpus: int = 0
    """The job's GPUs on all its nodes (nodes x gpus_per_node), for its GPU-hours."""
    gpu_hour_price: float = 0.0
    """What a GPU-hour costs (spec.json's run.gpu_hour_price; 0: not priced)."""

    @property
    def ranks(self) -> range:
        """The global ranks on this node (Slurm's block distribution, as meshrun.launcher.rank.env assumes)."""
        return range(self.node_rank * self.tasks_per_node, (self.node_rank + 1) * self.tasks_per_node)


def read_settings(run_dir: RunDir, environ: Mapping[str, str], log: LogFn) -> Settings:
    from meshrun.launcher.contract.spec.job import read_run_spec  # torch-free

    node_rank = int(environ.get("SLURM_NODEID", "0") or 0)
    try:
        spec = read_run_spec(Path(run_dir.root))
    except Exception as exc:
        log(f"spec.json unusable ({exc}): sampling every {DEFAULT_INTERVAL_S:g} s, one rank per GPU, no watchdog")
        return Settings(node_rank=node_rank)
    job = spec.job
    return Settings(
        interval_s=job.sidecar.interval_s,
        tasks_per_node=job.tasks_per_node,
        node_rank=node_rank,
        nodes=int(environ.get("SLURM_NNODES") or job.resources.nodes),
        watchdog=job.watchdog if job.watchdog.enabled else None,
        scratch_dir=spec.run.scratch_dir,
        checkpoint_dir=spec.run.checkpoint_dir or run_dir.default_checkpoints,
        keep=job.checkpoint.keep,
        keep_every=job.checkpoint.keep_every,
        final_copy_s=job.sidecar.final_copy_s,
        alerts=job.alerts,
        suspects_file=spec.run.suspects_file,
        gpus=job.resources.nodes * job.resources.gpus_per_node,
        gpu_hour_price=spec.run.gpu_hour_price,
    )


def started_at(environ: Mapping[str, str]) -> float:
    """The attempt's sidecar start on this node: its keeper's start, else now."""
    try:
        return float(environ.get(SINCE_ENV) or time.time())
    except ValueError:
        return time.time()


class Sidecar:
    """One node's sidecar: what it samples, where it writes, and its periodic tasks."""

    def __init__(
        self,
        run_dir: RunDir,
        node: str,
        environ: Mapping[str, str],
        log: LogFn,
        open_nvml: Callable[[], Any] = load_nvml,
        host: Optional[Host] = None,
    ) -> None:
        self.run_dir, self.node, self.environ, self.log = run_dir, node, environ, log
        self.settings = read_settings(run_dir, environ, log)
        self.host = host or Host()
        if not self.host.available:
            log("no /proc here: no host metrics")
        self.gpus = self._open_gpus(open_nvml)
        self.energy = EnergyMeter(nvml_gpus(self.gpus.nvml, self.gpus.targets) if self.gpus else [], rapl_packages())
        self.tb = self._open_tb()
        self.samples = 0
        self.mismatches_logged: set[str] = set()
        self.record = envrecord.build_record(node, environ, self.gpus.describe() if self.gpus else None)
        envrecord.write_record(run_dir.env_record(node), self.record)
        self.started = started_at(environ)
        self.node_dir = run_dir.node_dir(expand_node_path(self.settings.scratch_dir), node)
        self.attempt = attempt_id(environ)
        self.alerting = Alerting(
            run_dir, node, self.settings.node_rank, self.settings.alerts, log, self.step, self.settings.suspects_file
        )
        self.watchdog = self._open_watchdog()
        self.copier = self._open_copier()
        self._stamped = -STAMP_S

    def _open_watchdog(self) -> Optional[HangWatch]:
        s = self.settings
        if s.watchdog is None:
            self.log("no hang watch (watchdog.enabled is false, or spec.json is unusable)")
            return None
        return HangWatch(
            self.run_dir,
            self.node_dir,
            self.node,
            s.node_rank,
            s.nodes,
            s.ranks,
            s.watchdog,
            self.attempt,
            self.log,
            gpu_snapshot=self.gpu_snapshot,
            on_scalars=self.add_scalars,
            on_straggler=self.alerting.on_straggler,
            on_verdict=self.alerting.on_verdict,
        )

    def _open_copier(self) -> Optional[Copier]:
        s = self.settings
        if not s.scratch_dir:
            return None  # no node-local scratch: the ranks save straight to shared storage
        from meshrun.launcher.sidecar.copier import (
            Copier,  # only with scratch: ~12 ms of each sidecar's start without it
        )

        self.log(f"checkpoints are staged in {self.node_dir.staging} and copied to {s.checkpoint_dir}")
        return Copier(
            self.node_dir.staging,
            s.checkpoint_dir,
            self.node,
            s.node_rank,
            s.nodes,
            self.attempt,
            s.keep,
            s.keep_every,
            self.log,
            on_commit=self.record_commit,
        )

    def stamp_path(self, node_rank: int) -> str:
        return self.run_dir.path(self.run_dir.INTERNAL, "sidecars", f"{node_rank}.json")

    def stamp(self, state: str) -> None:
        """This node's sidecar is `state` ("running": refreshed every STAMP_S; "stopped": its copies are
        over), for node rank 0's final wait. A sidecar killed for good stops refreshing it."""
        if self.settings.nodes > 1:
            data = {"attempt": self.attempt, "node": self.node, "state": state, "time": time.time()}
            write_json(self.stamp_path(self.settings.node_rank), data)

    def stamp_running(self) -> None:
        if time.monotonic() >= self._stamped + STAMP_S:
            self._stamped = time.monotonic()
            self.stamp("running")

    def sidecars_gone(self) -> set[int]:
        """The other nodes whose sidecar of this attempt has stopped, or has not stamped for STAMP_STALE_S."""
        gone = set()
        for node_rank in range(1, self.settings.nodes):
            stamp = read_state(self.stamp_path(node_rank))
            if stamp.get("attempt") != self.attempt:
                continue  # not started yet, or an earlier attempt's: unknown, so waited for
            if stamp.get("state") == "stopped" or time.time() - float(stamp.get("time") or 0) > STAMP_STALE_S:
                gone.add(node_rank)
        return gone

    def record_commit(self, step: int) -> None:
        """A step complete on shared storage, as a metrics.jsonl event: status's CKPT is what resume can use
        (the trainer's own event for a staged save says "staged": only on scratch then). Node rank 0's
        sidecar runs on rank 0's machine: its appends and rank 0's stay whole lines."""
        note_checkpoint(self.run_dir.root, step)
        event = {"event": "checkpoint", "checkpoint_step": step, "copied": True, "time": time.time()}
        line = json.dumps({**event, **job_field(os.environ)})
        fd = os.open(self.run_dir.metrics, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)

    def gpu_snapshot(self) -> list[dict[str, Any]]:
        """The node's GPUs (and host) now, for a hang's diagnosis."""
        now = time.time()
        rows = (
            [{"kind": "gpu", "rank": self.rank_of(r["local_rank"]), **r} for r in self.gpus.sample(now)]
            if self.gpus
            else []
        )
        host = self.host.sample()
        return [*rows, {"kind": "host", **host}] if host else rows

    def step(self) -> Optional[int]:
        """The node's newest step (its ranks' heartbeats, as the hang watch reads them), for alerts."""
        steps = [b["step"] for b in self.watchdog.live_beats().values()] if self.watchdog is not None else []
        return max(steps) if steps else None

    def account(self) -> None:
        """The job's goodput so far, for `status JOB` (RUN_DIR/.meshrun/goodput/JOB.json) and TensorBoard."""
        job = job_of(self.environ)
        figures = goodput.write(self.run_dir.root, job) if job else None
        if figures is not None:
            parts = {f"goodput/{k}_s": v for k, v in figures["parts_s"].items()}
            pct = figures["effective_pct"]  # None: too soon to say (not a 0 on the chart)
            self.add_scalars(
                {**({"goodput/effective_pct": pct} if pct is not None else {}), **parts, **self.used(figures)}
            )

    def used(self, figures: Mapping[str, Any]) -> dict[str, float]:
        """The job's GPU-hours so far (its GPUs over its allocated time) and, where priced, their cost."""
        if not self.settings.gpus:
            return {}
        hours = self.settings.gpus * float(figures["allocated_s"]) / 3600
        price = self.settings.gpu_hour_price
        return {"usage/gpu_hours": hours, **({"usage/cost": hours * price} if price else {})}

    def add_scalars(self, scalars: dict[str, float]) -> None:
        """Scalars from the watchdog (straggler ratios) into this node's TensorBoard files."""
        if self.tb is not None:
            self.tb.add(self.samples, scalars_of(scalars, skip=()), time.time())
            self.tb.flush()

    def _open_gpus(self, open_nvml: Callable[[], Any]) -> Optional[Gpus]:
        visible_env = self.environ.get("CUDA_VISIBLE_DEVICES")
        visible = None if visible_env is None else tuple(e.strip() for e in visible_env.split(",") if e.strip())
        if visible == ():
            self.log("the job has no GPUs here (CUDA_VISIBLE_DEVICES is empty): host metrics only")
            return None
        try:
            nvml = open_nvml()
        except NvmlUnavailable as exc:
            self.log(f"no GPU metrics: {exc}; host CPU, memory and disk I/O only")
            return None
        targets, problems = resolve(visible, discover(nvml), self.settings.tasks_per_node)
        for problem in problems:
            self.log(problem)
        shown = ", ".join(f"CUDA {t.cuda_index}={t.uuid} (local rank {t.local_rank})" for t in targets)
        self.log(f"GPU metrics for {len(targets)} GPU(s): {shown or 'none'}")
        return Gpus(nvml, targets, self.log)

    def _open_tb(self) -> Any:
        from meshrun.launcher.train.tbwriter import ScalarWriter  # the trainer's writer: one way to write event files

        writer = ScalarWriter(self.run_dir.sidecar_tensorboard(self.node), session_start=False)
        if not writer.enabled:
            self.log("no TensorBoard files: cannot import tensorboard; gpu.jsonl has every sample")
            return None
        return writer

    def rank_of(self, local_rank: Optional[int]) -> Optional[int]:
        if local_rank is None:
            return None
        return self.settings.node_rank * self.settings.tasks_per_node + local_rank

    def sample(self) -> None:
        """One line per GPU and one for the host, appended to gpu.jsonl in one write; scalars to TensorBoard."""
        now = time.time()
        lines: list[dict[str, Any]] = []
        gpu_rows: list[dict[str, Any]] = []
        scalars: dict[str, Any] = {}
        host = self.host.sample()
        if host:
            lines.append({"time": round(now, 3), "node": self.node, "kind": "host", **host})
            scalars.update({f"host/{key}": value for key, value in host.items()})
        for row in self.gpus.sample(now) if self.gpus else []:
            rank = self.rank_of(row["local_rank"])
            lines.append({"time": round(now, 3), "node": self.node, "kind": "gpu", "rank": rank, **row})
            gpu_rows.append(lines[-1])
            label = f"rank{rank}" if rank is not None else row["uuid"][:12]
            scalars.update(
                {f"gpu/{label}/{key}": value for key, value in row.items() if key not in ("cuda_index", "local_rank")}
            )
        scalars.update(self.measure_energy(now))
        if lines:
            text = "".join(json.dumps(line, sort_keys=True) + "\n" for line in lines)
            fd = os.open(self.run_dir.gpu_metrics, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            try:
                os.write(fd, text.encode())
            finally:
                os.close(fd)
        if self.tb is not None:
            self.tb.add(self.samples, scalars_of(scalars, skip=()), now)
            self.tb.flush()
        self.alerting.on_sample(gpu_rows, now)
        self.samples += 1

    def measure_energy(self, now: float) -> dict[str, float]:
        """This node's energy of the job so far into RUN_DIR/.meshrun/energy/JOB.NODE.json (launcher/contract/
        energy.py, null where unmeasured), for `meshrun status`; what was measured, as TensorBoard scalars."""
        job = job_of(self.environ)
        if not job:
            return {}
        used = self.energy.read()
        gpus = len(self.gpus.targets) if self.gpus else 0
        record = {"job": job, "node": self.node, "gpus": gpus, **used, "since": self.started, "time": round(now, 3)}
        write_json(self.run_dir.energy(job, self.node), record)
        return {f"energy/{key[:-2]}_kj": value / 1000 for key, value in used.items() if value is not None}

    def check_env(self) -> None:
        """Warn (once each) when this run's nodes differ in driver, CUDA, torch, NCCL, meshrun or Python."""
        records = envrecord.read_records(self.run_dir.path(self.run_dir.ENV), self.record["run"])
        for line in envrecord.env_mismatches(records):
            if line not in self.mismatches_logged:
                self.mismatches_logged.add(line)
                self.log(f"warning: {line}")

    def tasks(self) -> list[Periodic]:
        extra = []
        if self.watchdog is not None:
            extra.append(Periodic("hang watch", WATCH_S, self.watchdog.tick))
        if self.copier is not None:
            extra.append(Periodic("checkpoint copier", WATCH_S, self.copier.tick))
        if self.alerting.forwarder is not None:
            extra.append(Periodic("alert forwarding", WATCH_S, self.alerting.forward))
        if self.copier is not None and self.settings.nodes > 1:
            extra.append(Periodic("liveness stamp", WATCH_S, self.stamp_running))
        if self.settings.node_rank == 0 and job_of(self.environ):
            extra.append(Periodic("goodput", GOODPUT_S, self.account, next_at=time.monotonic() + GOODPUT_S))
        log_times = logtimes.LogTimes(str(self.run_dir.root), self.settings.ranks)  # `logs --rank all`'s order
        return [
            *extra,
            Periodic("log times", logtimes.SAMPLE_S, lambda: log_times.tick(time.time())),
            Periodic("sample", self.settings.interval_s, self.sample),
            Periodic(
                "env check",
                ENV_CHECK_S,
                self.check_env,
                next_at=time.monotonic() + min(ENV_CHECK_S, 2 * self.settings.interval_s),
            ),
        ]

    def last_beats(self) -> dict[str, dict[str, Any]]:
        """This node's ranks' newest heartbeats of this attempt, by rank."""
        beats = {}
        for rank in self.settings.ranks:
            beat = read_state(self.node_dir.progress(rank))
            if beat and float(beat.get("time", 0)) >= self.started - STALE_BEAT_S:
                beats[str(rank)] = beat
        return beats

    def ranks_alive(self) -> bool:
        """Whether a rank of this node (a pid its heartbeat names) still runs."""
        return any(rank_alive(beat) for beat in self.last_beats().values())

    def record_last_beats(self) -> None:
        """Each rank's last step and phase into the run dir (scratch is cleared): what a post-mortem reads."""
        beats = self.last_beats()
        if beats:
            write_json(self.run_dir.last_beats(self.node), {"node": self.node, "attempt": self.attempt, "beats": beats})

    def finish_copies(self) -> None:
        """When the ranks have ended: copy what is still only on scratch, within sidecar.final_copy_s."""
        if self.copier is None:
            return
        self.copier.drain(
            time.monotonic() + self.settings.final_copy_s, gone=self.sidecars_gone, on_poll=self.stamp_running
        )
        self.stamp("stopped")
        if self.ranks_alive():
            # Never under live ranks (a sidecar whose parent was killed, or past END_WAIT_S): their
            # heartbeats and next saves go there. The next attempt's sidecar prunes what is left.
            self.log(f"this node's ranks still run: {self.node_dir.root} stays")
            return
        self._clear_scratch()

    def _clear_scratch(self) -> None:
        """The attempt is over: its files on this node's scratch go. What was copied is verified on shared
        storage (node rank 0 commits from there), what was not was logged as lost, and no later attempt
        ever uses another's staged steps."""
        shutil.rmtree(self.node_dir.root, ignore_errors=True)
        try:
            os.rmdir(os.path.dirname(self.node_dir.root))  # the run's scratch folder, once every node's is gone
        except OSError:
            pass

    def close(self) -> None:
        if self.watchdog is not None:
            # A verdict another node wrote in this attempt's last second: srun ended this node's ranks and the
            # batch script this sidecar before a tick saw it, and its alert and suspect nodes were lost.
            self.watchdog.last_look()
        self.alerting.forward()  # what the other nodes wrote in the last second
        try:
            self.measure_energy(time.time())  # to the end: the last sample may be an interval old
        except OSError as exc:
            self.log(f"the last energy record was not written: {exc}")
        if self.tb is not None:
            self.tb.close()
        if self.gpus is not None:
            self.gpus.close()
