"""A stalled rendezvous, judged across nodes from the ranks' heartbeats: pure functions, torch-free, stdlib only.

The built-in trainer's ranks stamp phase "rendezvous" before they reach rank 0's store and "setup" once every rank
has arrived in it (launcher/train/runtime.py). Each node's hang watch keeps when its ranks reached the rendezvous
and whether one of them left it (RendezvousTrack), and shares that beside its step times
(RUN_DIR/.meshrun/steptimes/NODE.json, every watchdog.straggler_check_s). Node 0's hang watch judges: a rendezvous
that a rank reached watchdog.rendezvous_stall_s ago and that no rank has left is stalled. No rank leaves before
every rank has arrived, so one rank past it means it completed, whatever an older share of another node says.
The verdict names the nodes of the ranks that never reached it (a requeued start once waited 42 s on a store that
could not answer, and the setup timeout would have waited 20 minutes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

PHASE = "rendezvous"


@dataclass
class RendezvousTrack:
    """One node's ranks at the rendezvous of this attempt, from their heartbeats."""

    reached: dict[int, float] = field(default_factory=dict)
    """rank -> when its heartbeat first said it was at (or past) the rendezvous."""
    left: bool = False
    """Whether a rank of this node was seen past the rendezvous (any phase after it)."""

    def observe(self, rank: int, beat: Mapping[str, Any]) -> None:
        """Take one heartbeat of this attempt. A command job's ranks never say "rendezvous": their first beat,
        in any other phase, counts as past it (they are never judged)."""
        self.reached.setdefault(rank, float(beat["time"]))
        if beat.get("phase") != PHASE:
            self.left = True

    def share(self) -> dict[str, Any]:
        """What the node shares with the others (JSON: rank keys are strings)."""
        return {"reached": {str(rank): at for rank, at in sorted(self.reached.items())}, "left": self.left}


@dataclass(frozen=True)
class NodeView:
    """One node's share of this attempt."""

    node: str
    node_rank: int
    reached: Mapping[int, float]
    left: bool


@dataclass(frozen=True)
class Stall:
    """A stalled rendezvous: how long since the first rank reached it, and who did not."""

    waited_s: float
    stall_s: float
    missing: tuple[tuple[str, tuple[int, ...]], ...]
    """(node, its ranks that never reached the rendezvous), by node index; empty: every rank reached it."""
    store_node: str
    """Where rank 0's store is (node index 0)."""

    def headline(self) -> str:
        """One sentence without '. ' in it (status shows a verdict's first sentence)."""
        limit = f"(watchdog.rendezvous_stall_s {self.stall_s:g} s)"
        if not self.missing:
            return (
                f"rendezvous stalled: every rank reached it but it did not complete in {self.waited_s:.0f} s "
                f"{limit}; rank 0's store is on node {self.store_node}"
            )
        who = ", ".join(f"node {node} ({rank_span(ranks)})" for node, ranks in self.missing)
        return f"rendezvous stalled: {who} did not join in {self.waited_s:.0f} s {limit}"

    def to_json(self) -> dict[str, Any]:
        return {
            "waited_s": round(self.waited_s, 3),
            "stall_s": self.stall_s,
            "missing": [{"node": node, "ranks": list(ranks)} for node, ranks in self.missing],
            "store_node": self.store_node,
            "headline": self.headline(),
        }


def rank_span(ranks: Sequence[int]) -> str:
    """'rank 4', 'ranks 4-5', 'ranks 1, 3'."""
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if list(ranks) == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


def views(files: Sequence[Mapping[str, Any]], attempt: str) -> list[NodeView]:
    """The nodes' shares of this attempt (RunDir.step_times files); a malformed one is skipped."""
    out = []
    for data in files:
        share = data.get("rendezvous")
        if data.get("attempt") != attempt or not isinstance(data.get("node_rank"), int) or not isinstance(share, dict):
            continue
        reached = share.get("reached")
        if not isinstance(reached, dict):
            continue
        try:
            times = {int(rank): float(at) for rank, at in reached.items()}
        except (TypeError, ValueError):
            continue
        out.append(NodeView(str(data.get("node", "?")), int(data["node_rank"]), times, bool(share.get("left"))))
    return out


def judge(
    nodes: Sequence[NodeView], node_count: int, tasks_per_node: int, now: float, stall_s: float
) -> Optional[Stall]:
    """The stall, if the rendezvous is stalled at `now`: reached by a rank stall_s ago or more, left by none."""
    if any(view.left for view in nodes):
        return None
    reached = {rank: at for view in nodes for rank, at in view.reached.items()}
    if not reached or now - min(reached.values()) < stall_s:
        return None
    names = {view.node_rank: view.node for view in nodes}
    missing: dict[int, list[int]] = {}
    for rank in range(node_count * tasks_per_node):
        if rank not in reached:
            missing.setdefault(rank // tasks_per_node, []).append(rank)
    return Stall(
        waited_s=now - min(reached.values()),
        stall_s=stall_s,
        missing=tuple((names.get(index, f"index {index}"), tuple(ranks)) for index, ranks in sorted(missing.items())),
        store_node=names.get(0, "index 0"),
    )


def missing_ranks(stall: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A claim's stall as verdict.json rank entries: the ranks that never joined are the stalled ones (their nodes
    are blamed as a hang's stalled ranks' nodes are: launcher/contract/records/suspects.py blamed_nodes)."""
    out = []
    for entry in stall.get("missing") or []:
        if not isinstance(entry, dict):
            continue
        for rank in entry.get("ranks") or []:
            out.append(
                {
                    "rank": rank,
                    "node": entry.get("node"),
                    "pid": None,
                    "step": None,
                    "phase": PHASE,
                    "state": "stalled",
                    "where": "did not join the rendezvous",
                }
            )
    return out
