"""The hang watchdog: one per node, in the sidecar, from the ranks' heartbeats. Torch-free, stdlib only.

Each tick (every second; a few stats, a read only when a file changed) it reads this node's ranks'
heartbeats. When no rank of the node progressed for the current phase's timeout, it claims the hang
for the whole job (RUN_DIR/diagnosis/.claim, O_EXCL: the sidecars share only the run dir). Every
node that sees a claim of its attempt contributes once, before anything is killed: it signals its
ranks for a faulthandler stack dump (only pids whose heartbeat names the signal), asks NCCL ranks for
a flight-recorder dump, and copies both with the heartbeats and a GPU snapshot into
RUN_DIR/diagnosis/NODE/ (done.json last). The claiming node waits for every node's done.json (at
most watchdog.diagnosis_wait_s), then writes the verdict and the exit code 76. Every node that sees
the verdict of its attempt SIGKILLs its ranks: srun's --kill-on-bad-exit ends the job, the batch
script requeues on 76. Straggler detection rides on the same heartbeats (launcher/sidecar/stragglers.py).
"""

from __future__ import annotations

import json
import os
import signal
import stat
import time
from typing import Any, Callable, Optional, Sequence

from meshrun.launcher.contract import procs
from meshrun.launcher.contract.exitcodes import EXIT_NO_PROGRESS
from meshrun.launcher.contract.private import make_private_dir
from meshrun.launcher.contract.records.rundir import NodeDir, RunDir, write_json
from meshrun.launcher.contract.spec.job import Watchdog as WatchdogSettings
from meshrun.launcher.sidecar import diagnosis, rendezvous
from meshrun.launcher.sidecar.beats import (
    WARMUP_DURATIONS,
    RankTrack,
    file_size,
    phase_timeout,
    read_json,
    write_text,
)
from meshrun.launcher.sidecar.stragglers import RankTime, StragglerTracker, rank_times, read_step_times

STALE_GRACE_S = 5.0
"""Beats older than the watchdog's start minus this are a previous attempt's leftovers."""
STACK_WAIT_S = 5.0
"""How long a node waits for its ranks' stack and flight-recorder dumps before writing its part."""
ORPHAN_CLAIM_S = 15.0
"""A claim with no verdict this long after diagnosis_wait_s: its node died; any node writes the verdict."""
TIMEOUT_LOG_RATIO = 1.5
"""The timeout in force is logged again when it changes by more than this factor."""
CLAIM = ".claim"


class Watchdog:
    """This node's hang watch and its part of the job-wide diagnosis; see the module's docstring."""

    def __init__(
        self,
        run_dir: RunDir,
        node_dir: NodeDir,
        node: str,
        node_rank: int,
        nodes: int,
        ranks: Sequence[int],
        settings: WatchdogSettings,
        attempt: str,
        log: Callable[[str], None],
        gpu_snapshot: Callable[[], list[dict[str, Any]]] = lambda: [],
        clock: Callable[[], float] = time.time,
        kill: Optional[Callable[[int, int], None]] = None,
        on_scalars: Optional[Callable[[dict[str, float]], None]] = None,
        on_straggler: Optional[Callable[[RankTime, float, float, float, float], None]] = None,
        on_verdict: Optional[Callable[[dict[str, Any], float], None]] = None,
    ) -> None:
        self.run_dir, self.node_dir, self.node, self.node_rank = run_dir, node_dir, node, node_rank
        self.nodes, self.ranks, self.settings, self.attempt = nodes, tuple(ranks), settings, attempt
        self.log, self.gpu_snapshot, self.clock, self.kill, self.on_scalars = log, gpu_snapshot, clock, kill, on_scalars
        self.created = clock()
        # The job this sidecar serves: a pid from a heartbeat is signalled only if it belongs to it.
        self.job = procs.current_job()
        self.tracks = {rank: RankTrack() for rank in self.ranks}
        self.progress_at: Optional[float] = None
        self.stats: dict[str, tuple[int, int, int]] = {}
        self.cache: dict[str, Optional[dict[str, Any]]] = {}
        self.logged_timeout: Optional[float] = None
        self.said_no_beats = False
        self.next_share = self.created
        self.stragglers = StragglerTracker(settings.straggler_factor, log, on_named=on_straggler)
        self.on_verdict = on_verdict
        self.contribution = ""  # "", "waiting", "done"
        self.waiting_since = 0.0
        self.dumps: dict[str, int] = {}  # dump file -> size before the signal (or last seen size)
        self.sizes: dict[str, int] = {}
        self._ended = False
        self.rendezvous = rendezvous.RendezvousTrack()
        self.rendezvous_done = False  # node 0: a rank was seen past it, no more judging in this attempt
        self.stall: Optional[rendezvous.Stall] = None

    @property
    def ended(self) -> bool:
        return self._ended

    @property
    def claim_path(self) -> str:
        return self.run_dir.path(RunDir.DIAGNOSIS, CLAIM)

    def tick(self) -> None:
        if self._ended:
            return
        now = self.clock()
        self._read_beats(now)
        if now >= self.next_share:
            self.next_share = now + self.settings.straggler_check_s  # node rank 0 checks as often
            self._share_step_times(now)
            if self.node_rank == 0:
                self._check_stragglers(now)
                self._judge_rendezvous(now)
        claim = self._ours(self.claim_path)
        if claim is None and self.settings.enabled:
            self._watch(now)
            claim = self._ours(self.claim_path)
        if claim is None:
            return
        if self.contribution == "":
            self._start_contribution(now)
        if self.contribution == "waiting":
            self._continue_contribution(now)
        verdict_seen = self._ours(self.run_dir.verdict_json) is not None
        late = now - float(claim.get("time", now)) > self.settings.diagnosis_wait_s + ORPHAN_CLAIM_S
        if not verdict_seen and (claim.get("node") == self.node or late):
            verdict_seen = self._maybe_verdict(now, claim)
        if verdict_seen:
            self._end()

    # --- heartbeats and the timeout -------------------------------------------------------------
    def _changed(self, path: str) -> bool:
        """One stat: did the file change since the last read (a missing file never has)?"""
        try:
            st = os.stat(path)
        except OSError:
            return False
        key = (st.st_mtime_ns, st.st_size, st.st_ino)
        if self.stats.get(path) == key:
            return False
        self.stats[path] = key
        return True

    def _ours(self, path: str) -> Optional[dict[str, Any]]:
        """The JSON file if it belongs to this attempt (read only when it changed)."""
        if self._changed(path):
            self.cache[path] = read_json(path)
            if self.cache[path] is None:
                self.stats.pop(path, None)  # half written: read it again next tick
        data = self.cache.get(path)
        return data if data is not None and data.get("attempt") == self.attempt else None

    def _read_beats(self, now: float) -> None:
        for rank, track in self.tracks.items():
            path = self.node_dir.progress(rank)
            if not self._changed(path):
                continue
            beat = read_json(path)
            if beat is None or not isinstance(beat.get("step"), int) or not isinstance(beat.get("time"), (int, float)):
                self.stats.pop(path, None)
                continue
            if beat["time"] < self.created - STALE_GRACE_S:
                continue  # a previous attempt's leftover
            self.rendezvous.observe(rank, beat)
            if track.observe(beat):
                seen = min(float(beat["time"]), now)
                self.progress_at = seen if self.progress_at is None else max(self.progress_at, seen)

    def live_beats(self) -> dict[int, dict[str, Any]]:
        return {rank: track.beat for rank, track in self.tracks.items() if track.beat}

    def durations(self) -> list[float]:
        return [d for track in self.tracks.values() for d in track.durations]

    def current(self) -> tuple[Optional[int], str, float]:
        """The node's step and phase (its newest beat's) and the timeout in force."""
        beats = self.live_beats()
        newest = max(beats.values(), key=lambda b: float(b["time"]))
        durations = self.durations() if max(len(t.durations) for t in self.tracks.values()) >= WARMUP_DURATIONS else []
        phase = str(newest.get("phase", "setup"))
        return newest.get("step"), phase, phase_timeout(self.settings, phase, durations)

    def _judge_rendezvous(self, now: float) -> None:
        """Node 0, at each share: a stalled rendezvous (launcher/sidecar/rendezvous.py), from every node's share."""
        if self.rendezvous_done or self.stall is not None:
            return
        shared = rendezvous.views(read_step_times(self.run_dir, self.node), self.attempt)
        if any(view.left for view in shared):
            self.rendezvous_done = True
            return
        self.stall = rendezvous.judge(shared, self.nodes, len(self.ranks), now, self.settings.rendezvous_stall_s)

    def _watch(self, now: float) -> None:
        if self.stall is not None:
            # Judged by node 0 before any heartbeat of its own, if need be: its own ranks may be the missing ones.
            headline = self.stall.headline()
            self.log(f"{headline}: a hang")
            self._claim(now, 0, rendezvous.PHASE, self.stall.waited_s, self.stall.stall_s, self.stall.to_json())
            self.stall = None
            return
        if self.progress_at is None:
            if not self.said_no_beats and now - self.created >= self.settings.setup_timeout_s:
                self.said_no_beats = True
                self.log(
                    f"no heartbeat from ranks {', '.join(map(str, self.ranks))} after "
                    f"{now - self.created:.0f} s: no hang watch (a command job gets one by calling "
                    "meshrun.launcher.report.report())"
                )
            return
        step, phase, timeout = self.current()
        last = self.logged_timeout
        if last is None or not last / TIMEOUT_LOG_RATIO <= timeout <= last * TIMEOUT_LOG_RATIO:
            self.logged_timeout = timeout
            self.log(f"hang timeout now {timeout:.0f} s (phase {phase}, step {step})")
        silent = now - self.progress_at
        if silent > timeout:
            self.log(f"no progress for {silent:.0f} s at step {step} (phase {phase}, timeout {timeout:.0f} s): a hang")
            self._claim(now, step, phase, silent, timeout)

    # --- the claim --------------------------------------------------------------------------------
    def _claim(
        self,
        now: float,
        step: Optional[int],
        phase: str,
        silent: float,
        timeout: float,
        stall: Optional[dict[str, Any]] = None,
    ) -> None:
        """Create the claim (O_EXCL); replace one of another attempt under a per-attempt lock, so that of
        two nodes finding the same stale claim exactly one replaces it. `stall`: a stalled rendezvous's record."""
        make_private_dir(self.run_dir.diagnosis)
        data: dict[str, Any] = {
            "attempt": self.attempt,
            "node": self.node,
            "time": now,
            "step": step,
            "phase": phase,
            "silent_s": round(silent, 3),
            "timeout_s": round(timeout, 3),
            **({"rendezvous": stall} if stall else {}),
        }
        try:
            fd = os.open(self.claim_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            self._replace_stale_claim(data)
            return
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(json.dumps(data))
        self.log(f"claimed the hang for attempt {self.attempt}: collecting every node's diagnosis")

    def _replace_stale_claim(self, data: dict[str, Any]) -> None:
        existing = read_json(self.claim_path)
        if existing is None:
            try:
                young = time.time() - os.stat(self.claim_path).st_mtime < 10
            except OSError:
                return  # gone: the next tick creates it
            if young:
                return  # being written by another node: read it next tick
        elif existing.get("attempt") == self.attempt:
            return  # another node of this attempt claimed first
        try:
            os.mkdir(self.run_dir.path(RunDir.DIAGNOSIS, f"{CLAIM}.replace.{self.attempt}"), 0o700)
        except FileExistsError:
            return  # another node of this attempt is replacing it
        write_json(self.claim_path, data)
        self.log(
            f"claimed the hang for attempt {self.attempt} (replaced a stale claim): collecting every node's diagnosis"
        )

    # --- this node's part -------------------------------------------------------------------------
    def _alive(self, beat: dict[str, Any]) -> bool:
        """Whether the heartbeat's pid still names the rank that wrote it, in this job."""
        pid = beat.get("pid")
        if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
            return False
        if self.kill is not None:  # a test's stand-in for the processes
            try:
                self.kill(pid, 0)
            except ProcessLookupError:
                return False
            return True
        identity = procs.Identity.from_json(beat)
        if identity is None:  # a heartbeat without its start time: its pid cannot be told from a reuse
            return False
        return procs.alive(identity) and (self.job is None or procs.in_job(pid, self.job))

    def _signal(self, beat: dict[str, Any], sig: int) -> bool:
        """Signal the rank that wrote `beat`, only while its pid still names it (meshrun.launcher.contract.procs): a pid from
        a file may be another process's by now, on a node shared with other jobs and daemons."""
        pid = int(beat["pid"])
        if self.kill is not None:
            self.kill(pid, sig)
            return True
        identity = procs.Identity.from_json(beat)
        return identity is not None and procs.signal_if_same(identity, sig, self.job)

    def _start_contribution(self, now: float) -> None:
        self.contribution, self.waiting_since = "waiting", now
        signalled = []
        for rank, beat in sorted(self.live_beats().items()):
            pid, sig = beat.get("pid"), beat.get("stack_signal")
            if not isinstance(sig, int) or not self._alive(beat):
                continue
            self.dumps[self.node_dir.stack(rank)] = max(file_size(self.node_dir.stack(rank)), 0)
            try:
                if self._signal(beat, sig):
                    signalled.append(rank)
            except OSError as exc:
                self.log(f"cannot signal rank {rank} (pid {pid}) for its stack: {exc}")
        for rank in self.ranks:
            pipe = f"{self.node_dir.nccl_pipe_prefix}{rank}.pipe"
            try:
                if not stat.S_ISFIFO(os.stat(pipe).st_mode):
                    continue
                fd = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO when no rank reads it: skip
                os.write(fd, b"1\n")
                os.close(fd)
                self.dumps[self.node_dir.nccl_prefix + str(rank)] = 0
            except OSError:
                continue
        self.log(
            f"hang diagnosis: asked ranks {signalled or 'none'} for their stacks; waiting up to {STACK_WAIT_S:g} s"
        )

    def _continue_contribution(self, now: float) -> None:
        """Write the part once every dump grew and kept its size across a tick, or the wait is over."""
        sizes = {path: file_size(path) for path in self.dumps}
        settled = all(size > self.dumps[path] and size == self.sizes.get(path) for path, size in sizes.items())
        self.sizes = sizes
        if settled or now - self.waiting_since >= STACK_WAIT_S:
            self._write_part(now)

    def _write_part(self, now: float) -> None:
        folder = self.run_dir.node_diagnosis(self.node)
        make_private_dir(folder)
        for name in os.listdir(folder):  # a previous attempt's part
            if os.path.isfile(os.path.join(folder, name)):
                os.unlink(os.path.join(folder, name))
        stacks = []
        for rank in self.ranks:
            path = self.node_dir.stack(rank)
            if path in self.dumps and file_size(path) > self.dumps[path]:
                with open(path, "rb") as handle:
                    handle.seek(self.dumps[path])
                    write_text(os.path.join(folder, f"rank-{rank}.stack.txt"), handle.read().decode(errors="replace"))
                stacks.append(rank)
            trace = self.node_dir.nccl_prefix + str(rank)
            if trace in self.dumps and file_size(trace) > 0:
                with open(trace, "rb") as src, open(os.path.join(folder, f"nccl-trace-rank-{rank}"), "wb") as dst:
                    dst.write(src.read())
        beats = {str(rank): beat for rank, beat in self.live_beats().items()}
        steps = {str(rank): list(t.durations) for rank, t in self.tracks.items()}
        write_json(
            os.path.join(folder, "heartbeats.json"),
            {"node": self.node, "attempt": self.attempt, "time": now, "beats": beats, "step_times": steps},
        )
        try:
            gpus: list[dict[str, Any]] = self.gpu_snapshot()
        except Exception as exc:  # a GPU snapshot must not cost the rest of the diagnosis
            gpus = [{"error": f"{type(exc).__name__}: {exc}"}]
        write_json(os.path.join(folder, "gpus.json"), {"gpus": gpus})
        write_json(
            os.path.join(folder, "done.json"),
            {"attempt": self.attempt, "node": self.node, "time": now, "ranks": list(self.ranks), "stacks": stacks},
        )
        self.contribution = "done"
        self.log(f"hang diagnosis: this node's part is in {folder} (stacks of ranks {stacks or 'none'})")

    # --- the verdict and the end ------------------------------------------------------------------
    def _done_nodes(self) -> dict[str, str]:
        """Nodes whose part of this attempt is complete: name -> folder."""
        out = {}
        try:
            names = os.listdir(self.run_dir.diagnosis)
        except OSError:
            return {}
        for name in names:
            folder = self.run_dir.node_diagnosis(name)
            done = read_json(os.path.join(folder, "done.json"))
            if done is not None and done.get("attempt") == self.attempt:
                out[name] = folder
        return out

    def _maybe_verdict(self, now: float, claim: dict[str, Any]) -> bool:
        if self.contribution != "done":
            return False  # this node's own part first (it takes at most STACK_WAIT_S)
        done = self._done_nodes()
        if len(done) < self.nodes and now - float(claim.get("time", now)) < self.settings.diagnosis_wait_s:
            return False
        evidence = []
        for name, folder in sorted(done.items()):
            beats = (read_json(os.path.join(folder, "heartbeats.json")) or {}).get("beats") or {}
            for rank_text, beat in beats.items():
                try:
                    with open(os.path.join(folder, f"rank-{rank_text}.stack.txt"), encoding="utf-8") as handle:
                        stack: Optional[str] = handle.read()
                except OSError:
                    stack = None
                evidence.append(
                    diagnosis.RankEvidence(
                        int(rank_text), name, beat.get("pid"), beat.get("step"), str(beat.get("phase", "")), stack
                    )
                )
        missing = self._missing_nodes(set(done), now)
        hang = diagnosis.Hang(
            self.attempt,
            str(claim.get("node")),
            float(claim.get("time", now)),
            claim.get("step"),
            str(claim.get("phase", "")),
            float(claim.get("silent_s", 0)),
            float(claim.get("timeout_s", 0)),
            headline=str((claim.get("rendezvous") or {}).get("headline") or ""),
        )
        text, data = diagnosis.verdict(hang, evidence, missing, self.settings.diagnosis_wait_s, self.run_dir.diagnosis)
        if isinstance(claim.get("rendezvous"), dict):
            data["rendezvous"] = claim["rendezvous"]
            data["ranks"] += rendezvous.missing_ranks(claim["rendezvous"])
        write_text(self.run_dir.verdict, text + "\n")
        write_text(self.run_dir.exit_code, f"{EXIT_NO_PROGRESS}\n")
        write_json(self.run_dir.verdict_json, data)  # last: every node ends its ranks once it exists
        self.log(f"verdict: {text}")
        return True

    def _missing_nodes(self, done: set[str], now: float) -> list[str]:
        """The nodes without a part, by name where their shared step times name them."""
        shared = read_step_times(self.run_dir, self.node)
        known = {str(data.get("node")) for data in shared if data.get("attempt") == self.attempt}
        missing = sorted(known - done)
        unnamed = self.nodes - len(done) - len(missing)
        if unnamed > 0:
            missing.append(f"{unnamed} more node(s)")
        return missing

    def _end(self) -> None:
        if self.contribution == "waiting":
            try:
                self._write_part(self.clock())
            except OSError as exc:  # the ranks end all the same: a hung job must not stay
                self.log(f"hang diagnosis: cannot write this node's part: {exc}")
        killed = []
        for rank, beat in sorted(self.live_beats().items()):
            pid = beat.get("pid")
            if self._alive(beat):
                try:
                    if self._signal(beat, signal.SIGKILL):
                        killed.append(f"{rank} (pid {pid})")
                except OSError as exc:
                    self.log(f"cannot kill rank {rank} (pid {pid}): {exc}")
        self.log(f"hang verdict: killed ranks {', '.join(killed) or 'none (already gone)'}; the job ends with exit 76")
        self._ended = True
        verdict = self._ours(self.run_dir.verdict_json)
        if self.on_verdict is not None and verdict is not None:
            self.on_verdict(verdict, self.clock())  # after the kill: an alert never delays the job's end

    def last_look(self) -> None:
        """The sidecar stops: a verdict of this attempt that no tick saw yet still reaches on_verdict (node 0 raises
        its alert and records the nodes it blames; on_verdict is once per attempt)."""
        if self._ended or self.on_verdict is None:
            return
        verdict = self._ours(self.run_dir.verdict_json)
        if verdict is not None:
            self.on_verdict(verdict, self.clock())

    # --- stragglers -------------------------------------------------------------------------------
    def _share_step_times(self, now: float) -> None:
        ranks = {str(rank): track.medians() for rank, track in self.tracks.items() if track.beat}
        data = {"node": self.node, "node_rank": self.node_rank, "attempt": self.attempt, "time": now, "ranks": ranks}
        data["rendezvous"] = self.rendezvous.share()  # also with no rank there yet: it names this node
        write_json(self.run_dir.step_times(self.node), data)

    def _check_stragglers(self, now: float) -> None:
        times = rank_times(read_step_times(self.run_dir, self.node), self.attempt, now)
        if not times:
            return
        report, scalars = self.stragglers.check(times, now)
        write_json(self.run_dir.stragglers, report)
        if self.on_scalars is not None:
            self.on_scalars(scalars)
