"""A hang's verdict from the ranks' stacks and heartbeats: pure functions, torch-free, stdlib only.

Input is what the watchdog collected (launcher/sidecar/watchdog.py): each rank's faulthandler dump
(every thread, "most recent call first") and its last heartbeat. Output is one paragraph a person
reads first, and the same as data (RUN_DIR/diagnosis/verdict.json).

Rules, kept simple so that a verdict can be checked by hand against the dump:
- The main training thread of a rank is the thread whose outermost frame is the program's entry,
  `<module>` (below runpy's frames with `python -m`). With none (an embedded interpreter), the
  longest thread not started by `threading`; last, the longest one.
- A rank waits in a collective when its innermost frame outside the standard library is in
  torch.distributed or is a function named like a collective (all_reduce, barrier, broadcast,
  all_gather*, reduce_scatter*, all_to_all*, send, recv, wait, ...). The collective named is the
  innermost collective-named frame of that block; its caller is the first frame outside torch.
- Otherwise the rank is stalled elsewhere: at its innermost frame outside the standard library.
- A rank whose heartbeat step is behind the furthest rank's is a suspect, and is named first.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional, Sequence

COLLECTIVES = frozenset(
    {
        "all_reduce",
        "barrier",
        "monitored_barrier",
        "broadcast",
        "broadcast_object_list",
        "reduce",
        "gather",
        "gather_object",
        "scatter",
        "scatter_object_list",
        "send",
        "recv",
        "isend",
        "irecv",
        "batch_isend_irecv",
        "wait",
        "all_reduce_coalesced",
    }
)
COLLECTIVE_PREFIXES = ("all_gather", "reduce_scatter", "all_to_all")

_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+)")
_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+) in (?P<function>.+?)\s*$')
# The standard library of whichever python the rank ran (a command job's may differ from ours).
_STDLIB = re.compile(r"/lib/python3(\.\d+)?/(?!site-packages/|dist-packages/)|^<frozen ")
_TORCH = re.compile(r"/torch/")
_TORCH_DISTRIBUTED = re.compile(r"/torch/distributed/")


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    function: str

    @property
    def place(self) -> str:
        return f"{short_path(self.file)}:{self.line}"


@dataclass(frozen=True)
class Thread:
    ident: str
    current: bool
    frames: tuple[Frame, ...]
    """Innermost first, as faulthandler prints them."""


@dataclass(frozen=True)
class Where:
    state: str
    """"collective", "stalled" or "no stack"."""
    function: str = ""
    frame: Optional[Frame] = None
    """Stalled: the frame it is stuck in. Collective: the first caller outside torch (if any)."""

    def describe(self) -> str:
        if self.state == "no stack":
            return "no stack"
        if self.state == "collective":
            caller = f" (called from {self.frame.place} {self.frame.function})" if self.frame else ""
            return f"{self.function}{caller}"
        place = f" ({self.frame.place})" if self.frame else ""
        return f"{self.function}{place}"


@dataclass(frozen=True)
class RankEvidence:
    """What the watchdog collected about one rank."""

    rank: int
    node: str
    pid: Optional[int]
    step: Optional[int]
    phase: str
    stack: Optional[str]
    """faulthandler's text, or None when the rank could not be asked or did not answer."""


@dataclass(frozen=True)
class Hang:
    """The claim: which attempt, found by which node, at what step, after how long."""

    attempt: str
    found_by: str
    time: float
    step: Optional[int]
    phase: str
    silent_s: float
    timeout_s: float
    headline: str = ""
    """The first sentence instead of 'Hang at step N ...' (a stalled rendezvous names who did not join)."""


def short_path(path: str) -> str:
    """A file as a person recognises it: from the package folder on (site-packages stripped, meshrun's own
    files from launcher/ on), else as given."""
    for marker in ("/site-packages/", "/dist-packages/"):
        if marker in path:
            return path.split(marker, 1)[1]
    match = re.search(r"(?:^|/)(launcher|submit)/", path)
    if match:
        return path[match.start(1) :]
    return path


def parse_stack(text: str) -> list[Thread]:
    """faulthandler's dump as threads; a thread dumped twice (two signals) keeps its last dump."""
    threads: dict[str, Thread] = {}
    ident, current = "", False
    frames: list[Frame] = []
    for line in text.splitlines():
        head = _THREAD.match(line)
        if head:
            if ident:
                threads[ident] = Thread(ident, current, tuple(frames))
            ident, current, frames = head.group(2), head.group(1) == "Current thread", []
            continue
        frame = _FRAME.match(line)
        if frame and ident:
            frames.append(Frame(frame["file"], int(frame["line"]), frame["function"]))
    if ident:
        threads[ident] = Thread(ident, current, tuple(frames))
    return list(threads.values())


def main_thread(threads: Sequence[Thread]) -> Optional[Thread]:
    """The training thread: outermost own frame `<module>`; else the longest non-`threading` thread; else the longest."""
    with_frames = [t for t in threads if t.frames]
    if not with_frames:
        return None
    entry = [t for t in with_frames if _entry(t).function == "<module>"]
    if entry:
        return entry[0]
    own = [t for t in with_frames if not t.frames[-1].file.endswith("threading.py")]
    return max(own or with_frames, key=lambda t: len(t.frames))


def _entry(thread: Thread) -> Frame:
    """The outermost frame of the program itself: `python -m` adds runpy's frames outside it."""
    frames = [f for f in thread.frames if not (f.file == "<frozen runpy>" or f.file.endswith("/runpy.py"))]
    return (frames or list(thread.frames))[-1]


def is_collective(function: str) -> bool:
    return function in COLLECTIVES or function.startswith(COLLECTIVE_PREFIXES)


def is_stdlib(frame: Frame) -> bool:
    return bool(_STDLIB.search(frame.file))


def classify(thread: Optional[Thread]) -> Where:
    """Where one rank's training thread is: in a collective (which, called from where) or stalled (where)."""
    if thread is None:
        return Where("no stack")
    own = [f for f in thread.frames if not is_stdlib(f)]
    if not own:
        first = thread.frames[0]
        return Where("stalled", first.function, first)
    first = own[0]
    if not (_TORCH_DISTRIBUTED.search(first.file) or is_collective(first.function)):
        return Where("stalled", first.function, first)
    name, caller = "", None
    for frame in own:
        if _TORCH.search(frame.file) or is_collective(frame.function):
            if not name and is_collective(frame.function):
                name = frame.function
            continue
        caller = frame
        break
    return Where("collective", name or first.function, caller)


def where_of(stack: Optional[str]) -> Where:
    if not stack or not stack.strip():
        return Where("no stack")
    return classify(main_thread(parse_stack(stack)))


def _ranks_text(ranks: Sequence[RankEvidence]) -> str:
    numbers = ", ".join(str(r.rank) for r in ranks)
    nodes = ", ".join(sorted({r.node for r in ranks}))
    word = "rank" if len(ranks) == 1 else "ranks"
    if len(ranks) == 1 and ranks[0].pid is not None:
        return f"{word} {numbers} ({nodes}, pid {ranks[0].pid})"
    return f"{word} {numbers} ({nodes})"


def _sentences(evidence: Sequence[RankEvidence], wheres: dict[int, Where]) -> list[str]:
    """Suspects (behind, or stalled outside a collective) first, then the groups waiting in a collective."""
    steps = [r.step for r in evidence if r.step is not None]
    top = max(steps) if steps else None
    behind = {r.rank for r in evidence if top is not None and r.step is not None and r.step < top}
    stalled = [r for r in evidence if wheres[r.rank].state == "stalled"]
    out: list[str] = []
    for rank in sorted(stalled, key=lambda r: (r.rank not in behind, r.rank)):
        late = f", behind at step {rank.step}" if rank.rank in behind else ""
        out.append(f"{_ranks_text([rank])} stalled in {wheres[rank.rank].describe()}, not in a collective{late}")
    groups: dict[str, list[RankEvidence]] = {}
    for rank in evidence:
        if wheres[rank.rank].state == "collective":
            groups.setdefault(wheres[rank.rank].describe(), []).append(rank)
    for text, ranks in groups.items():
        verb = "waits" if len(ranks) == 1 else "wait"
        lagging = [r.rank for r in ranks if r.rank in behind]
        extra = f" (behind: rank {', '.join(map(str, lagging))})" if lagging else ""
        out.append(f"{_ranks_text(ranks)} {verb} in {text}{extra}")
    silent = [r for r in evidence if wheres[r.rank].state == "no stack"]
    if silent:
        lagging = [r.rank for r in silent if r.rank in behind]
        extra = f", behind: rank {', '.join(map(str, lagging))}" if lagging else ""
        out.append(f"{_ranks_text(silent)} gave no stack{extra}")
    return out


def verdict(
    hang: Hang, evidence: Sequence[RankEvidence], missing: Sequence[str], wait_s: float, diagnosis_dir: str
) -> tuple[str, dict[str, Any]]:
    """The one-paragraph verdict and verdict.json's content."""
    ordered = sorted(evidence, key=lambda r: r.rank)
    wheres = {r.rank: where_of(r.stack) for r in ordered}
    step = "?" if hang.step is None else str(hang.step)
    parts = [
        f"{hang.headline[0].upper()}{hang.headline[1:]}, found by {hang.found_by}."
        if hang.headline
        else f"Hang at step {step} (phase {hang.phase}), found by {hang.found_by} after {hang.silent_s:.0f} s "
        f"without progress (timeout {hang.timeout_s:.0f} s)."
    ]
    sentences = _sentences(ordered, wheres)
    if sentences:
        joined = "; ".join(sentences)
        parts.append(joined[0].upper() + joined[1:] + ".")
    if missing:
        parts.append(f"{', '.join(missing)} sent no diagnosis within {wait_s:.0f} s.")
    parts.append(
        f"Stacks, heartbeats and GPU state: {diagnosis_dir}/. "
        "The job ends with exit 76 (no progress): Slurm requeues it from its last checkpoint (on the local "
        "cluster `meshrun resume` does)."
    )
    text = " ".join(parts)
    data: dict[str, Any] = {
        "attempt": hang.attempt,
        "time": hang.time,
        "step": hang.step,
        "phase": hang.phase,
        "found_by": hang.found_by,
        "silent_s": round(hang.silent_s, 3),
        "timeout_s": round(hang.timeout_s, 3),
        "verdict": text,
        "missing_nodes": list(missing),
        "ranks": [
            {
                "rank": r.rank,
                "node": r.node,
                "pid": r.pid,
                "step": r.step,
                "phase": r.phase,
                "state": wheres[r.rank].state,
                "where": wheres[r.rank].describe(),
            }
            for r in ordered
        ],
    }
    return text, data
