"""The cluster's ledger of suspect nodes: remembered across requeues and new submits.

One JSON line per finding (a hang verdict's stalled nodes, a failed health check, a straggler, a hardware XID),
appended where the jobs run (WORK_DIR/.meshrun/suspect-nodes.jsonl: shared
storage, private to the user): {"node", "evidence", "job", "time"}; `meshrun nodes --clear NODE` appends
{"node", "cleared": true, "time"}. A node is suspect while it has a finding newer than its last clearing and
younger than the job's `resilience.forget_after`: a node clean for that long is tried again. New submits
leave suspects out (`submit/jobs/suspects.py`, as many as the partition can spare). Torch-free, stdlib only.
"""

from __future__ import annotations

import json
import posixpath
import time
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional

LEDGER = posixpath.join(".meshrun", "suspect-nodes.jsonl")
"""The ledger's path under the cluster's work dir."""
FORGET_AFTER_S = 24 * 3600
"""How long a finding keeps a node suspect unless the job's spec says otherwise (resilience.forget_after)."""


HARDWARE_XIDS = frozenset({48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120, 140})
"""XID codes that point at the GPU or its node (double-bit ECC, row remapping, NVLink, fallen off the bus, GSP
errors), not at the program (13, 31, 43: its own illegal access): a node that reports one is a suspect."""


def ledger_path(work_dir: str) -> str:
    return posixpath.join(work_dir, LEDGER)


@dataclass(frozen=True)
class Finding:
    node: str
    evidence: str
    """What was seen, in words: a hang verdict's first sentence naming the node."""
    job: str
    time: float


def parse(lines: Iterable[str]) -> list[Mapping[str, Any]]:
    """The ledger's whole JSON object lines (a torn or garbled one is skipped)."""
    found: list[Mapping[str, Any]] = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("node"), str) and isinstance(row.get("time"), (int, float)):
            found.append(row)
    return found


def suspects(
    rows: Iterable[Mapping[str, Any]], now: float, forget_after_s: float = FORGET_AFTER_S
) -> dict[str, Finding]:
    """Each suspect node's newest finding: newer than the node's last clearing, younger than forget_after_s."""
    newest: dict[str, Finding] = {}
    cleared: dict[str, float] = {}
    for row in sorted(rows, key=lambda r: float(r["time"])):
        node, when = str(row["node"]), float(row["time"])
        if row.get("cleared"):
            cleared[node] = when
            newest.pop(node, None)
        elif now - when <= forget_after_s:
            newest[node] = Finding(node, str(row.get("evidence") or "?"), str(row.get("job") or "?"), when)
    return {node: f for node, f in newest.items() if f.time > cleared.get(node, float("-inf"))}


def finding_line(node: str, evidence: str, job: str, now: Optional[float] = None) -> str:
    return json.dumps({"node": node, "evidence": evidence, "job": job, "time": time.time() if now is None else now})


def cleared_line(node: str, now: Optional[float] = None) -> str:
    return json.dumps({"node": node, "cleared": True, "time": time.time() if now is None else now})


def blamed_nodes(verdict: Mapping[str, Any]) -> list[str]:
    """The nodes of the ranks a hang verdict found stalled (the sidecar's verdict.json), sorted."""
    stalled = [r for r in verdict.get("ranks") or [] if isinstance(r, dict) and r.get("state") == "stalled"]
    return sorted({str(r["node"]) for r in stalled if r.get("node")})


def verdict_evidence(verdict: Mapping[str, Any]) -> str:
    """A hang verdict as a suspect's evidence: its first sentence."""
    return "hang verdict: " + str(verdict.get("verdict") or "a hang").split(". ")[0].strip()


def ago(seconds: float) -> str:
    """'3 min ago', '5 h ago': how long since a finding (the render warning and `meshrun nodes` alike)."""
    return f"{int(seconds // 60)} min ago" if seconds < 7200 else f"{seconds / 3600:.0f} h ago"
