"""The cluster's suspect nodes as submit sees them (launcher/contract/records/suspects.py keeps the ledger): read over
the transport in one command (planning.plan.avoid_suspects leaves them out of a new job), cleared by
`meshrun nodes --clear`."""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from meshrun.launcher.contract.records import suspects
from meshrun.submit.config.cluster import check_node_names
from meshrun.submit.transport.base import Transport

READ_BYTES = 1 << 20
"""The ledger's newest this many bytes are read (a torn first line is skipped)."""


def read(transport: Transport, work_dir: str) -> list[Mapping[str, Any]]:
    """The ledger's lines on the cluster ([] when it has none)."""
    path = suspects.ledger_path(work_dir)
    done = transport.run(["sh", "-c", 'tail -c "$1" -- "$2" 2>/dev/null || true', "sh", str(READ_BYTES), path])
    return suspects.parse(done.stdout.splitlines())


def clear(transport: Transport, work_dir: str, nodes: Sequence[str], now: Optional[float] = None) -> None:
    """Append a clearing line per node (the ledger stays append-only: a job writing beside it loses nothing)."""
    path = suspects.ledger_path(work_dir)
    lines = "".join(suspects.cleared_line(node, now) + "\n" for node in check_node_names("--clear", list(nodes)))
    script = 'umask 077; mkdir -p -- "$(dirname -- "$1")" && printf %s "$2" >> "$1"'
    transport.run(["sh", "-c", script, "sh", path, lines]).check("clear the suspect nodes")
