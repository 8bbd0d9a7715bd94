"""The environment comparison: which versions differ between the nodes of one run. Torch-free, stdlib only.

A contract module: each node's sidecar writes RUN_DIR/env/NODE.json (launcher/sidecar/envrecord.py)
and compares the records in its log; `meshrun status JOB` compares the same records with the same
function, so both say the same thing. Every record is optional and may be half-written: unreadable
ones are skipped, never fatal.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable, Mapping, Optional

from meshrun.launcher.contract.nodelist import compress

COMPARED = ("driver", "cuda", "torch", "nccl", "meshrun", "python")
"""Versions that must agree between the nodes of one run (a mismatch is a warning)."""


def parse_record(text: str) -> Optional[dict[str, Any]]:
    """One record from its file's text; None when it is not a JSON object (half-written, garbled)."""
    try:
        record = json.loads(text)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def read_records(folder: str, run: Optional[str] = None) -> list[dict[str, Any]]:
    """Every node's record in `folder` (RUN_DIR/env), only run `run`'s when given; unreadable ones skipped."""
    records = []
    try:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".json") and not n.startswith("."))
    except OSError:
        return []
    for name in names:
        try:
            with open(os.path.join(folder, name), encoding="utf-8", errors="replace") as handle:
                record = parse_record(handle.read())
        except OSError:
            continue
        if record is not None and (run is None or record.get("run") == run):
            records.append(record)
    return records


def newest_run(records: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The records of the newest run only: a requeue that landed on other nodes leaves the old
    nodes' records behind, and those must not be compared with this run's."""
    records = list(records)
    stamped = [r for r in records if isinstance(r.get("time"), (int, float))]
    if not stamped:
        return records
    run = max(stamped, key=lambda r: float(r["time"])).get("run")
    return [r for r in records if r.get("run") == run]


def env_mismatches(records: Iterable[Mapping[str, Any]]) -> list[str]:
    """One line per version that differs between nodes, e.g.
    "driver differs between nodes: 550.54 on n1; 535.104 on n2". Pure; [] when all agree."""
    lines = []
    records = list(records)
    for key in COMPARED:
        nodes_by_value: dict[str, list[str]] = {}
        for record in records:
            value = record.get(key)
            if value is None:
                continue  # not known there (no NVML, no NCCL wheel): nothing to compare
            nodes_by_value.setdefault(str(value), []).append(str(record.get("node", "?")))
        if len(nodes_by_value) > 1:
            parts = "; ".join(f"{value} on {compress(nodes)}" for value, nodes in sorted(nodes_by_value.items()))
            lines.append(f"{key} differs between nodes: {parts}")
    return lines
