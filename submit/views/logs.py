"""`meshrun logs`: print or follow a job's log files, exactly, across dropped connections.

Each file is a Source with a byte offset. Following runs one `tail -c +OFFSET -F`
per file, all on the command's one connection, and counts the bytes that arrive.
If the connection drops, it reconnects and restarts every tail at its offset, so
no byte is lost or repeated. When the job has ended (checked with backoff, one
round trip each), what is left past each offset is read once more and it stops.
With several ranks each line is prefixed `[rank N] ` and what is already written is printed in the order it was
written (the sidecar's times, launcher/contract/records/logtimes.py); partial lines wait for their end.
Following a log bigger than FOLLOW_TAIL_BYTES starts at its last line that begins within that many
bytes of its end (as `tail -f` does): a 1 GB log shows its tail at once instead of streaming 1 GB;
`meshrun logs JOB` without -f still prints all of it.
`--diagnosis` prints a hang's diagnosis (the sidecar's files under RUN_DIR/diagnosis) in one command.
"""

from __future__ import annotations

import fnmatch
import heapq
import json
import math
import posixpath
import queue
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, BinaryIO, Iterator, Optional, Sequence, TextIO

from meshrun.launcher.contract.records import logtimes
from meshrun.launcher.contract.records.rundir import RunDir
from meshrun.submit import api
from meshrun.submit.core.registry import JobRecord
from meshrun.submit.errors import ClusterError, ConnectionLost, InputError
from meshrun.submit.transport.base import Stream, Transport, new_marker

RECONNECT_ATTEMPTS = 8
FOLLOW_TAIL_BYTES = 1 << 20
"""`logs -f` of a longer file starts this close to its end (at a line start); a shorter one from its start."""
INBOX_CHUNKS = 64
"""Chunks (of at most 64 KiB) read ahead of the output while following: its memory, whatever the log's rate."""


@dataclass
class Source:
    """One log file being printed (mutable: its offset advances as bytes are printed)."""

    path: str
    label: bytes = b""
    offset: int = 0
    partial: bytes = b""
    times: Optional[str] = None
    """Where the sidecar records when this rank's log grew (launcher/contract/records/logtimes.py): several ranks are
    merged in time order with it; None for the batch log."""


def parse_ranks(text: str, world_size: Optional[int]) -> list[int]:
    """'3' -> [3]; '0,2' -> [0, 2]; 'all' -> every rank (needs the world size)."""
    if text == "all":
        if not world_size:
            raise InputError("--rank", text, "the job's size is unknown (no spec.json yet); give rank numbers")
        return list(range(world_size))
    try:
        ranks = [int(part) for part in text.split(",")]
    except ValueError:
        raise InputError("--rank", text, "give a rank number, a list like 0,3, or all") from None
    for rank in ranks:
        if rank < 0:
            raise InputError("--rank", rank, "ranks are numbered from 0")
        if world_size and rank >= world_size:
            raise InputError(
                "--rank", rank, f"the job has {world_size} rank{'s' if world_size > 1 else ''} (0-{world_size - 1})"
            )
    return ranks


def select_ranks(transport: Transport, record: JobRecord, text: str) -> list[int]:
    """`--rank TEXT` for this job, checked against its world size when spec.json tells it.

    Always reads the size (one small read): a rank past the job's end must be refused,
    not answered with "no log yet" as if it might still appear.
    """
    return parse_ranks(text, world_size(transport, record))


def world_size(transport: Transport, record: JobRecord) -> Optional[int]:
    try:
        spec = json.loads(transport.read_bytes(RunDir(record.run_dir).spec))["job"]["resources"]
    except (ValueError, KeyError, TypeError):
        return None
    gpus = spec.get("gpus_per_node") or 0
    return int(spec.get("nodes", 1)) * int(spec.get("tasks_per_node") or max(gpus, 1))


class Printer:
    """Writes chunks to `out`: as they are (one source) or line by line with each source's label."""

    def __init__(self, out: BinaryIO, merged: bool) -> None:
        self.out, self.merged = out, merged

    def emit(self, source: Source, chunk: bytes) -> None:
        source.offset += len(chunk)
        if not self.merged:
            self.out.write(chunk)
        else:
            lines = (source.partial + chunk).split(b"\n")
            source.partial = lines.pop()
            self.out.write(b"".join(source.label + line + b"\n" for line in lines))
        self.out.flush()

    def finish(self, sources: Sequence[Source]) -> None:
        for source in sources:
            if self.merged and source.partial:
                self.out.write(source.label + source.partial + b"\n")
                source.partial = b""
        self.out.flush()


def _tail(source: Source, follow: bool) -> list[str]:
    return ["tail", "-c", f"+{source.offset + 1}", *(["-F"] if follow else []), "--", source.path]


def print_once(transport: Transport, sources: Sequence[Source], printer: Printer) -> None:
    """Print each file from its offset to its current end (one stream per file); several ranks in time order."""
    if printer.merged and len(sources) > 1:
        print_in_time_order(transport, sources, printer)
        printer.finish(sources)
        return
    for source in sources:
        stream = transport.stream(_tail(source, follow=False))
        try:
            for chunk in stream:
                printer.emit(source, chunk)
        finally:
            stream.close()
    printer.finish(sources)


TIMES_LIMIT = 16 << 20
"""The most of a rank's times file read: one short line per second of output, months of it."""


def print_in_time_order(transport: Transport, sources: Sequence[Source], printer: Printer) -> None:
    """Several ranks' logs from their offsets to their current ends, each line once, in the order they were
    written (to the sidecar's second; lines of one second stay in rank order, and lines it has not timed yet
    come last, rank by rank). One stream per file, all open at once and read as the merge needs them."""
    samples = [logtimes.parse(_read_times(transport, s)) for s in sources]
    streams = [transport.stream(_tail(s, follow=False)) for s in sources]
    try:
        lines = [_timed_lines(i, s, st, samples[i]) for i, (s, st) in enumerate(zip(sources, streams))]
        for _, index, line, size in heapq.merge(*lines, key=lambda item: item[:2]):
            source = sources[index]
            source.offset += size
            if line.endswith(b"\n"):
                printer.out.write(source.label + line)
            else:
                source.partial = line  # its end is still to come: `finish`, or the follow, completes it
        printer.out.flush()
    finally:
        for stream in streams:
            stream.close()


def _read_times(transport: Transport, source: Source) -> str:
    return transport.read_bytes(source.times, 0, TIMES_LIMIT).decode(errors="replace") if source.times else ""


def _timed_lines(
    index: int, source: Source, stream: Stream, samples: logtimes.Samples
) -> Iterator[tuple[float, int, bytes, int]]:
    """(when, index, line, bytes) for each line of the stream, in file order (so ascending in time)."""
    end, buf = source.offset, source.partial
    counted = len(buf)  # a partial line's bytes are in the offset already
    source.partial = b""
    for chunk in stream:
        data, start = buf + chunk, end - len(buf)
        end += len(chunk)
        *whole, buf = data.split(b"\n")
        for line in whole:
            start += len(line) + 1
            when = logtimes.written_at(samples, start)
            yield (math.inf if when is None else when, index, line + b"\n", len(line) + 1 - counted)
            counted = 0
    if buf:
        yield (math.inf, index, buf, len(buf) - counted)


# $1 and $2 the job's start lines (local, Slurm), then the files: each file's byte offset of the first line
# naming this job's start, or an empty line (none: an older log, or not a rank log).
_OWN_START_SCRIPT = 'a=$1; b=$2; shift 2; for f in "$@"; do grep -b -m1 -F -e "$a" -e "$b" -- "$f" 2>/dev/null | cut -d: -f1 | grep . || echo; done'


def start_at_own_run(transport: Transport, job_id: str, sources: Sequence[Source], err: TextIO) -> None:
    """A resumed job shares its rank logs with the jobs before it in the run dir (appended): its `logs` start
    at its own first line (the rank's start line naming its id), saying so, not at its parent's output."""
    markers = (f"[meshrun] local job {job_id} rank ", f" job {job_id} restart ")
    found = transport.run(["sh", "-c", _OWN_START_SCRIPT, "sh", *markers, *(s.path for s in sources)])
    offsets = found.stdout.split("\n") if found.returncode == 0 else []
    skipped = False
    for source, text in zip(sources, offsets):
        if source.offset == 0 and text.strip().isdigit() and int(text) > 0:
            source.offset, skipped = int(text), True
    if skipped:
        err.write(f"meshrun: from job {job_id}'s own start (earlier jobs of its run dir wrote above it)\n")
        err.flush()


def start_near_end(transport: Transport, sources: Sequence[Source], err: TextIO) -> None:
    """Move each not yet started source of a big file to the first line start in its last FOLLOW_TAIL_BYTES
    (two small reads per file, whatever its size), saying on `err` how much is skipped."""
    for source in sources:
        size = transport.size(source.path) if source.offset == 0 else 0
        if size <= FOLLOW_TAIL_BYTES:
            continue
        start = size - FOLLOW_TAIL_BYTES
        newline = transport.read_bytes(source.path, start - 1, 65536).find(
            b"\n"
        )  # from the byte before: on a line start?
        source.offset = start + newline if newline >= 0 else start
        err.write(
            f"meshrun: {source.path} is {size:,} bytes; following from its last {size - source.offset:,} "
            f"(`meshrun logs` without -f prints it all)\n"
        )
    err.flush()


def _pump(index: int, stream: Stream, inbox: queue.Queue[tuple[int, bytes, Optional[BaseException]]]) -> None:
    try:
        for chunk in stream:
            inbox.put((index, chunk, None))
        inbox.put((index, b"", None))  # ended by itself: restarted at its offset
    except BaseException as exc:  # noqa: BLE001 - handed to the main thread
        inbox.put((index, b"", exc))


class Follower:
    """`logs -f`: follow sources until the job ends, reconnecting when the connection drops."""

    def __init__(
        self, record: JobRecord, clusters: api.Clusters, sources: Sequence[Source], printer: Printer, err: TextIO
    ) -> None:
        self.record, self.clusters, self.sources, self.printer, self.err = record, clusters, sources, printer, err

    def run(self) -> None:
        started = False
        while True:
            try:
                transport = self.clusters.transport_for(self.record)
                if not started:
                    start_near_end(transport, self.sources, self.err)
                    if self.printer.merged and len(self.sources) > 1:
                        print_in_time_order(transport, self.sources, self.printer)  # what is there, in time order
                    started = True
                if self._follow(transport):
                    print_once(transport, self.sources, self.printer)  # what arrived after the last chunk
                    return
            except ConnectionLost:
                self._reconnect()

    def _job_done(self) -> bool:
        return api.statuses([self.record], self.clusters)[0].done

    def _follow(self, transport: Transport) -> bool:
        """Stream until the job is done (True) or a stream ended by itself (False: restart)."""
        # Bounded: a log growing faster than the output drains waits in `tail`'s pipe, not in this process.
        inbox: queue.Queue[tuple[int, bytes, Optional[BaseException]]] = queue.Queue(maxsize=INBOX_CHUNKS)
        streams = [transport.stream(_tail(s, follow=True)) for s in self.sources]
        threads = [threading.Thread(target=_pump, args=(i, st, inbox), daemon=True) for i, st in enumerate(streams)]
        for thread in threads:
            thread.start()
        interval, next_check = 1.0, time.monotonic()
        try:
            while True:
                try:
                    index, chunk, exc = inbox.get(timeout=max(0.0, next_check - time.monotonic()))
                except queue.Empty:
                    if self._job_done():
                        return True
                    interval = min(interval * 1.5, 5.0)  # a long job is not polled every second
                    next_check = time.monotonic() + interval
                    continue
                if exc is not None:
                    raise exc
                if not chunk:
                    time.sleep(1.0)
                    return False
                self.printer.emit(self.sources[index], chunk)
        finally:
            for stream in streams:
                stream.close()
            deadline = time.monotonic() + 10
            for thread in threads:
                while thread.is_alive() and time.monotonic() < deadline:
                    self._drain(inbox)  # a pump waiting on the full inbox can then end
                    thread.join(0.05)
            self._drain(inbox)

    def _drain(self, inbox: queue.Queue[tuple[int, bytes, Optional[BaseException]]]) -> None:
        """Print what arrived before the streams were closed: it is counted in the offsets."""
        while True:
            try:
                index, chunk, _ = inbox.get_nowait()
            except queue.Empty:
                return
            if chunk:
                self.printer.emit(self.sources[index], chunk)

    def _reconnect(self) -> None:
        reconnect(self.clusters, self.record, self.err)


def reconnect(clusters: api.Clusters, record: JobRecord, err: TextIO) -> None:
    """A dropped connection to the job's cluster opened again (with backoff), saying so on `err`."""
    err.write(f"meshrun: the connection to {record.cluster} was lost; reconnecting\n")
    err.flush()
    delay, last = 1.0, None
    for _ in range(RECONNECT_ATTEMPTS):
        try:
            clusters.reconnect(record)
            err.write("meshrun: reconnected; resuming where the output stopped\n")
            err.flush()
            return
        except ClusterError as exc:
            if not getattr(exc, "retry", True):
                raise
            last = exc
            time.sleep(delay)
            delay = min(delay * 2, 15.0)
    raise ClusterError(
        f"lost the connection to {record.cluster} and could not reconnect ({RECONNECT_ATTEMPTS} tries): {last}"
    )


def sources_for(
    clusters: api.Clusters, record: JobRecord, ranks_text: str, batch: bool, err: TextIO, follow: bool
) -> list[Source]:
    """The files `logs` prints: the batch log, or the chosen ranks' logs from the job's own first line. Asking
    the cluster (the job's size, where its lines start) survives a dropped connection when following."""
    if batch:
        return [Source(api.log_path(record, None))]
    for attempt in range(RECONNECT_ATTEMPTS):
        try:
            transport = clusters.transport_for(record)
            ranks = select_ranks(transport, record, ranks_text)
            label = len(ranks) > 1
            sources = [Source(api.log_path(record, r), f"[rank {r}] ".encode() if label else b"") for r in ranks]
            for source, rank in zip(sources, ranks):
                source.times = logtimes.times_path(record.run_dir, rank)
            start_at_own_run(transport, record.job_id, sources, err)
            return sources
        except ConnectionLost:
            if not follow or attempt == RECONNECT_ATTEMPTS - 1:
                raise
            reconnect(clusters, record, err)
    raise AssertionError("unreachable")  # the loop returns or raises


# ------------------------------------------------------------------ `logs JOB --diagnosis`

# $1 marker, $2 cap, $3 the diagnosis dir, then the patterns (relative paths) whose text is printed.
# Every file's name and size comes back; only those texts do (an NCCL flight-recorder dump is binary).
DIAGNOSIS_SCRIPT = (
    'm=$1; cap=$2; d=$3; shift 3; [ -d "$d" ] || exit 0; for f in "$d"/* "$d"/*/*; do [ -f "$f" ] || continue; '
    'r=${f#"$d"/}; printf "\\n%s file %s %s\\n" "$m" "$(wc -c < "$f" | tr -d " ")" "$r"; '
    'for p in "$@"; do case $r in $p) head -c "$cap" -- "$f"; break;; esac; done; done; exit 0'
)
SHOWN = (posixpath.basename(RunDir("").verdict), "*/rank-*.stack.txt", "*/heartbeats.json")
"""What is printed of a diagnosis (the sidecar's file names, see RunDir.node_diagnosis); the rest is listed."""
DIAGNOSIS_CAP = 262144


@dataclass(frozen=True)
class DiagnosisFile:
    path: str
    """Relative to RUN_DIR/diagnosis: verdict.txt, NODE/rank-N.stack.txt, NODE/heartbeats.json, ..."""
    size: int
    text: Optional[str]
    """Its text (capped) when it is one of SHOWN; None for the files only listed."""


def diagnosis_argv(run_dir: str, marker: str) -> list[str]:
    return ["sh", "-c", DIAGNOSIS_SCRIPT, "sh", marker, str(DIAGNOSIS_CAP), RunDir(run_dir).diagnosis, *SHOWN]


def parse_diagnosis(output: str, marker: str) -> list[DiagnosisFile]:
    found = []
    for part in output.split(f"\n{marker} file ")[1:]:
        head, newline, text = part.partition("\n")
        size, _, path = head.partition(" ")
        shown = any(fnmatch.fnmatchcase(path, p) for p in SHOWN)
        found.append(DiagnosisFile(path, int(size) if size.isdigit() else 0, text if shown and newline else None))
    return found


def fetch_diagnosis(transport: Transport, run_dir: str) -> list[DiagnosisFile]:
    """Every file of the run's diagnosis, in ONE command (locally or over SSH); [] when there is none."""
    marker = new_marker()
    done = transport.run(diagnosis_argv(run_dir, marker), timeout=120).check("reading the diagnosis")
    return parse_diagnosis(done.stdout, marker)


def _rank_key(path: str) -> tuple[int, str]:
    match = re.search(r"rank-(\d+)", path)
    return (int(match.group(1)) if match else -1, path)


def _beat_rank(beat: dict[str, Any]) -> int:
    rank = str(beat.get("rank"))
    return int(rank) if rank.isdigit() else -1


def _beat_time(beat: dict[str, Any]) -> list[str]:
    when = beat.get("time")
    if not isinstance(when, (int, float)) or isinstance(when, bool):
        return [f"time {when}"] if "time" in beat else []
    try:
        return [f"last beat {time.strftime('%H:%M:%S', time.localtime(when))}"]
    except (OverflowError, OSError, ValueError):
        return [f"time {when}"]


def heartbeat_lines(text: str) -> list[str]:
    """heartbeats.json ({"node", "attempt", "time", "beats": {RANK: beat}, "step_times": {RANK: [s, ...]}})
    as one line per rank; its text as it is when it has another shape (half-written, garbled)."""
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    beats = data.get("beats") if isinstance(data, dict) else None
    if not isinstance(beats, dict) or not all(isinstance(b, dict) for b in beats.values()):
        return text.rstrip("\n").splitlines()
    times = data.get("step_times") if isinstance(data, dict) else None
    rows = [{"rank": rank, **beat} for rank, beat in beats.items()]
    return [
        _beat_line(b, times.get(str(b["rank"])) if isinstance(times, dict) else None)
        for b in sorted(rows, key=_beat_rank)
    ]


def _beat_line(beat: dict[str, Any], step_times: Any) -> str:
    parts = [f"{k} {beat[k]}" for k in ("step", "phase", "pid") if k in beat] + _beat_time(beat)
    recent = [t for t in step_times if isinstance(t, (int, float))] if isinstance(step_times, list) else []
    if recent:
        parts.append(f"last step {recent[-1]:.2f} s")
    return f"rank {beat['rank']}" + (": " + ", ".join(parts) if parts else "")


def format_diagnosis(files: Sequence[DiagnosisFile], job_id: str, run_dir: str) -> str:
    """The verdict, then per node every rank's stack (a header line each), its heartbeats and what else is there."""
    if not files:
        return f"no hang was diagnosed for {job_id} (nothing in {RunDir(run_dir).diagnosis})\n"
    out: list[str] = []
    verdict = next((f for f in files if f.path == SHOWN[0]), None)
    out += ["== verdict", (verdict.text or "").rstrip("\n") if verdict else "(no verdict.txt)", ""]
    nodes = sorted({f.path.split("/", 1)[0] for f in files if "/" in f.path})
    for node in nodes:
        mine = sorted((f for f in files if f.path.startswith(node + "/")), key=lambda f: _rank_key(f.path))
        out.append(f"== node {node}")
        for f in mine:
            name = f.path.split("/", 1)[1]
            if f.text is not None and name.endswith(".stack.txt"):
                rank = _rank_key(name)[0]
                out += [f"-- rank {rank} stack ({name})", f.text.rstrip("\n"), ""]
        for f in mine:
            if f.text is not None and not f.path.endswith(".stack.txt"):
                out += [f"-- heartbeats ({f.path.split('/', 1)[1]})", *heartbeat_lines(f.text), ""]
        others = [f"{f.path.split('/', 1)[1]} ({f.size} bytes)" for f in mine if f.text is None]
        if others:
            out += ["-- also here: " + ", ".join(others), ""]
    loose = [f"{f.path} ({f.size} bytes)" for f in files if "/" not in f.path and f is not verdict]
    if loose:
        out.append("also: " + ", ".join(loose))
    out.append(f"(files in {RunDir(run_dir).diagnosis})")
    return "\n".join(out) + "\n"
