"""The sidecar's alert rules (GPU utilisation, GPU memory, stragglers, hangs) and their forwarding.
Torch-free, stdlib only.

Only node 0 writes RUN_DIR/alerts.jsonl (launcher/contract/records/alerts.py: appends from one machine stay whole
lines, even on NFS). Another node's sidecar appends to RunDir.node_alerts(node), and node 0's sidecar
copies the new complete lines of those files into alerts.jsonl every second. What it has forwarded is
found again in alerts.jsonl when it starts, so a requeued job's new sidecar forwards nothing twice.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Optional

from meshrun.launcher.contract.private import append_line
from meshrun.launcher.contract.records import alerts, suspects
from meshrun.launcher.contract.records.alerts import Alert
from meshrun.launcher.contract.records.rundir import RunDir, job_of
from meshrun.launcher.contract.spec.job import Alerts as AlertSettings
from meshrun.launcher.sidecar.stragglers import RankTime

LogFn = Callable[[str], None]
StepFn = Callable[[], Optional[int]]
ALERT_KEYS = frozenset(f.name for f in fields(Alert))


@dataclass
class Streak:
    """One GPU's run of samples over (or under) a threshold."""

    since: Optional[float] = None
    """When the run began (None: the last sample was not in one)."""
    fired: bool = False


@dataclass
class GpuRules:
    """gpu_util_low and gpu_memory_high, per GPU (by UUID), each once per streak."""

    settings: AlertSettings
    util: dict[str, Streak] = field(default_factory=dict)
    memory: dict[str, Streak] = field(default_factory=dict)

    def check(self, rows: list[dict[str, Any]], node: str, now: float, step: Optional[int]) -> list[Alert]:
        """The alerts one sample's GPU rows (nvml.Gpus.sample, with "rank") raise."""
        out = []
        for row in rows:
            uuid = str(row.get("uuid", "?"))
            for alert in (self._util(row, uuid, node, now, step), self._memory(row, uuid, node, now, step)):
                if alert is not None:
                    out.append(alert)
        return out

    def _util(self, row: dict[str, Any], uuid: str, node: str, now: float, step: Optional[int]) -> Optional[Alert]:
        below, minutes = self.settings.gpu_util_below_pct, self.settings.gpu_util_minutes
        util = row.get("util_pct")
        if below <= 0 or not isinstance(util, (int, float)):
            return None  # off, or the driver gave no reading: the streak neither grows nor breaks
        streak = self.util.setdefault(uuid, Streak())
        if util >= below:
            self.util[uuid] = Streak()
            return None
        streak.since = now if streak.since is None else streak.since
        if streak.fired or now - streak.since < minutes * 60:
            return None
        streak.fired = True
        return Alert(
            "gpu_util_low",
            float(util),
            below,
            f"GPU {uuid} ({_where(row, node)}) has been below {below:g}% utilisation for {minutes:g} min "
            f"(now {util:g}%): it waits on something (data loading, host work, a slow peer, a tiny batch); "
            "70-90% is healthy",
            step,
            row.get("rank"),
            node,
            now,
        )

    def _memory(self, row: dict[str, Any], uuid: str, node: str, now: float, step: Optional[int]) -> Optional[Alert]:
        limit = self.settings.gpu_memory_fraction
        used, total = row.get("mem_used_mib"), row.get("mem_total_mib")
        if limit <= 0 or not isinstance(used, (int, float)) or not isinstance(total, (int, float)) or total <= 0:
            return None
        fraction = used / total
        if fraction <= limit:
            self.memory[uuid] = Streak()
            return None
        streak = self.memory.setdefault(uuid, Streak(since=now))
        if streak.fired:
            return None
        streak.fired = True
        return Alert(
            "gpu_memory_high",
            round(fraction, 4),
            limit,
            f"GPU {uuid} ({_where(row, node)}) uses {used:g} of {total:g} MiB ({fraction:.0%}, over {limit:.0%}): "
            "close to running out; lower train.micro_batch or turn on train.activation_checkpointing",
            step,
            row.get("rank"),
            node,
            now,
        )


def _where(row: dict[str, Any], node: str) -> str:
    rank = row.get("rank")
    return f"rank {rank} on {node}" if rank is not None else f"no rank, on {node}"


def straggler_alert(
    t: RankTime, ratio: float, median_s: float, factor: float, now: float, step: Optional[int]
) -> Alert:
    return Alert(
        "straggler",
        round(ratio, 3),
        factor,
        f"rank {t.rank} ({t.node}) takes {t.value_s:.3g} s per step, {ratio:.2f}x the median {median_s:.3g} s: "
        f"every rank waits for it; look at {t.node}'s GPU (throttle, XID in gpu.jsonl) and its data loading",
        step,
        t.rank,
        t.node,
        now,
    )


def hang_alert(verdict: dict[str, Any], now: float) -> Alert:
    """The verdict.json of a hang as an alert: its first sentence, the stalled rank where there is one."""
    text = str(verdict.get("verdict") or "")
    head, dot, _ = text.partition(". ")
    stalled = [r for r in verdict.get("ranks") or [] if isinstance(r, dict) and r.get("state") == "stalled"]
    rank = stalled[0].get("rank") if stalled else None
    node = stalled[0].get("node") if stalled else verdict.get("found_by")
    step = verdict.get("step")
    return Alert(
        "hang",
        _number(verdict.get("silent_s")),
        _number(verdict.get("timeout_s")),
        (head + dot).strip() or "a hang (see `meshrun status JOB`)",
        step if isinstance(step, int) else None,
        rank if isinstance(rank, int) else None,
        str(node) if node is not None else None,
        now,
    )


def _number(value: Any) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) else None


def parse_line(line: bytes) -> Optional[Alert]:
    """One complete alerts.jsonl line as an Alert (None when garbled)."""
    try:
        record = json.loads(line)
        if not isinstance(record, dict):
            return None
        return Alert(**{k: v for k, v in record.items() if k in ALERT_KEYS})
    except (ValueError, TypeError):
        return None


@dataclass
class Forwarder:
    """Node 0's copy of the other nodes' alert files into alerts.jsonl: complete lines only, each once."""

    run_dir: RunDir
    log: LogFn
    offsets: dict[str, int] = field(default_factory=dict)
    """File -> bytes of it already forwarded (always the end of a complete line)."""

    @property
    def folder(self) -> str:
        return os.path.dirname(self.run_dir.node_alerts("x"))

    def files(self) -> list[str]:
        try:
            names = sorted(n for n in os.listdir(self.folder) if n.endswith(".jsonl"))
        except OSError:
            return []
        return [os.path.join(self.folder, name) for name in names]

    def resume(self) -> None:
        """Start after the last line of each file that alerts.jsonl already holds (an earlier sidecar of
        this run forwarded it): a requeued job's node 0 forwards the rest, nothing twice."""
        done = {json.dumps(r, sort_keys=True) for r in alerts.read(self.run_dir.alerts, limit=10**9)}
        for path in self.files():
            offset = 0
            for end, line in _complete_lines(path, 0):
                alert = parse_line(line)
                if alert is not None and json.dumps(alert.record(), sort_keys=True) in done:
                    offset = end
            self.offsets[path] = offset

    def forward(self) -> list[Alert]:
        """Append the new complete lines of every node's file to alerts.jsonl; returns them."""
        forwarded: list[Alert] = []
        for path in self.files():
            start = self.offsets.get(path, 0)
            for end, line in _complete_lines(path, start):
                alert = parse_line(line)
                if alert is not None:
                    forwarded.append(alert)
                elif line.strip():
                    self.log(f"alerts: skipped a garbled line of {path}")
                self.offsets[path] = end
        alerts.append(self.run_dir.alerts, forwarded)
        return forwarded


def _complete_lines(path: str, start: int) -> list[tuple[int, bytes]]:
    """(offset after it, line) for each complete line of `path` from `start`; a last line without its
    newline is being written and waits for the next read."""
    try:
        with open(path, "rb") as handle:
            handle.seek(start)
            data = handle.read()
    except OSError:
        return []
    out = []
    position = start
    for line in data.split(b"\n")[:-1]:  # the last piece: "" after a newline, or a line being written
        position += len(line) + 1
        out.append((position, line))
    return out


class Alerting:
    """One node's alerts: the rules' state, where they are written, and (node 0) the forwarding."""

    def __init__(
        self,
        run_dir: RunDir,
        node: str,
        node_rank: int,
        settings: AlertSettings,
        log: LogFn,
        step: StepFn,
        suspects_file: str = "",
    ) -> None:
        self.run_dir, self.node, self.node_rank, self.settings = run_dir, node, node_rank, settings
        self.suspects_file = suspects_file
        self.log, self.step = log, step
        self.gpu_rules = GpuRules(settings)
        self.hang_seen = False
        self.recorded: set[str] = set()
        """Evidence this sidecar already put in the ledger (a straggler or an XID is recorded once)."""
        self.forwarder: Optional[Forwarder] = None
        if node_rank == 0:
            self.forwarder = Forwarder(run_dir, log)
            self.forwarder.resume()

    @property
    def path(self) -> str:
        """Where this node's alerts go: alerts.jsonl on node 0, its own file elsewhere (node 0 forwards)."""
        return self.run_dir.alerts if self.node_rank == 0 else self.run_dir.node_alerts(self.node)

    def emit(self, raised: list[Alert]) -> None:
        """Log and append them; a write that fails is a log line (the rules run inside the hang watch)."""
        for alert in raised:
            self.log(alert.line())
        try:
            alerts.append(self.path, raised)
        except OSError as exc:
            self.log(f"alerts: cannot append to {self.path}: {exc}")
        if self.node_rank == 0:
            self.to_rank0_log(raised)

    def to_rank0_log(self, raised: list[Alert]) -> None:
        """The alerts' lines in rank 0's log too, where the loss rules' lines are (node 0 is rank 0's
        node: these appends and the rank's own are whole lines of one machine)."""
        if not raised:
            return
        text = "".join(f"{alert.line()} (sidecar {alert.node or self.node})\n" for alert in raised)
        try:
            fd = os.open(self.run_dir.rank_log(0), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            try:
                os.write(fd, text.encode())
            finally:
                os.close(fd)
        except OSError as exc:
            self.log(f"alerts: cannot append to {self.run_dir.rank_log(0)}: {exc}")

    def on_sample(self, rows: list[dict[str, Any]], now: float) -> None:
        """A sample's GPU rows (with "rank"); without NVML there are none, and no GPU alerts. A GPU's
        hardware XID makes this node a suspect."""
        if rows:
            self.emit(self.gpu_rules.check(rows, self.node, now, self.step()))
        for row in rows:
            for code in row.get("xid") or []:
                if code in suspects.HARDWARE_XIDS:
                    self.record_suspect(self.node, f"XID {code} on {row.get('uuid', 'a GPU')}", now)

    def on_straggler(self, t: RankTime, ratio: float, median_s: float, factor: float, now: float) -> None:
        """The straggler tracker (node 0's) named a rank: once per streak, the tracker's own rule. Its node is a
        suspect (a throttled GPU or a slow link is the node's, and every rank waits for it)."""
        if self.settings.stragglers:
            self.emit([straggler_alert(t, ratio, median_s, factor, now, self.step())])
        self.record_suspect(t.node, f"straggler: rank {t.rank} took {ratio:.2f}x the median step time", now)

    def on_verdict(self, verdict: dict[str, Any], now: float) -> None:
        """This node's watchdog saw its attempt's verdict. Node 0 raises the alert, whichever node wrote
        the verdict: every node sees it within a tick, and node 0 needs no forwarding from a node whose
        sidecar is about to stop."""
        if self.node_rank == 0 and not self.hang_seen:
            self.hang_seen = True
            self.blame(verdict, now)
            if self.settings.hangs:
                self.emit([hang_alert(verdict, now)])

    def blame(self, verdict: dict[str, Any], now: float) -> None:
        """The nodes of the ranks the verdict found stalled go in the cluster's ledger of suspects (new submits
        leave them out: launcher/contract/records/suspects.py), with the verdict's first sentence as the evidence."""
        for node in suspects.blamed_nodes(verdict):
            self.record_suspect(node, suspects.verdict_evidence(verdict), now)

    def record_suspect(self, node: str, evidence: str, now: float) -> None:
        """One finding in the cluster's ledger of suspect nodes (once per node and evidence kind a sidecar's life)."""
        kind = f"{node} {evidence.split(':')[0].split(' on ')[0]}"
        if not self.suspects_file or kind in self.recorded:
            return
        self.recorded.add(kind)
        try:
            append_line(self.suspects_file, suspects.finding_line(node, evidence, job_of(os.environ) or "?", now))
        except OSError as exc:
            self.log(f"suspects: cannot append to {self.suspects_file}: {exc}")
        else:
            self.log(f"suspects: {node} recorded as suspect ({evidence}; {self.suspects_file})")

    def forward(self) -> None:
        if self.forwarder is not None:
            self.to_rank0_log(self.forwarder.forward())
