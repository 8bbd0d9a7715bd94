"""`meshrun top [JOB...]`: one screen for every running job, refreshed every 2 s.

Each refresh is one `statuses(live=True)` call: one round trip per cluster brings every job's state,
its metrics tail (the newest step and the loss history), the newest gpu.jsonl lines, spec.json's
step count and the alerts. A terminal is redrawn in place with plain ANSI codes; anything else (a pipe,
a file) gets one refresh as plain lines and no escape codes.
"""

from __future__ import annotations

import shutil
import sys
import time
from typing import Any, Optional, Sequence, TextIO

from meshrun.submit.core.status import Status

BARS = "▁▂▃▄▅▆▇█"
SPARK = 20
"""The sparkline's width: the newest SPARK losses."""
REFRESH_S = 2.0
HEAD = (
    "JOB",
    "NAME",
    "CLUSTER",
    "STATE",
    "STEP",
    "LOSS",
    "HISTORY",
    "TOK/S",
    "MFU",
    "GPU",
    "MEM",
    "ETA",
    "LEFT",
    "RST",
    "GOODPUT",
    "USED",
    "ALERTS",
)


def sparkline(losses: Sequence[Optional[float]], width: int = SPARK) -> str:
    """The newest `width` losses as bars scaled between their min and max; '!' for a non-finite one."""
    recent = list(losses)[-width:]
    finite = [x for x in recent if x is not None]
    if not finite:
        return "!" * len(recent)
    low, high = min(finite), max(finite)
    span = (high - low) or 1.0
    return "".join("!" if x is None else BARS[int((x - low) / span * (len(BARS) - 1))] for x in recent)


def _number(value: Any) -> Optional[float]:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    return float(value) if ok else None


def gpu_cells(gpus: Sequence[dict[str, Any]]) -> tuple[str, str]:
    """(mean GPU utilisation, memory used/total in GiB summed over the GPUs) of the newest samples."""
    utils = [u for u in (_number(g.get("util_pct")) for g in gpus) if u is not None]
    used = [m for m in (_number(g.get("mem_used_mib")) for g in gpus) if m is not None]
    total = [m for m in (_number(g.get("mem_total_mib")) for g in gpus) if m is not None]
    util = f"{sum(utils) / len(utils):.0f}%" if utils else "-"
    memory = f"{sum(used) / 1024:.1f}/{sum(total) / 1024:.0f}G" if used and total else "-"
    return util, memory


def row(status: Status) -> tuple[str, ...]:
    from meshrun.submit.views.tables import alerts_note, duration, finish_in, limit_left, loss_text, restarts_cell

    p = status.progress
    step = p.get("step")
    tokens, mfu = _number(p.get("tokens_per_s")), _number(p.get("mfu"))
    util, memory = gpu_cells(status.gpus)
    return (
        status.job_id,
        status.name,
        status.cluster,
        status.state,
        "-" if step is None else f"{step}/{status.steps}" if status.steps else str(step),
        loss_text(p["loss"]) if "loss" in p else "-",
        sparkline(status.losses) or "-",
        f"{tokens:,.0f}" if tokens is not None else "-",
        f"{mfu:.1%}" if mfu is not None else "-",
        util,
        memory,
        duration(finish_in(status, status.steps)),
        duration(limit_left(status)),
        restarts_cell(status, short=True),
        goodput_cell(status.goodput),
        used_cell(status.usage),
        alerts_note(status.alerts),
    )


def used_cell(used: Optional[dict[str, Any]]) -> str:
    """What the job used so far (submit/core/usage.py), short: its cost where priced, else its GPU-hours, else the
    energy its nodes measured; '-' for none of them."""
    used = used or {}
    cost, hours = used.get("cost"), _number(used.get("gpu_hours"))
    if cost:
        return f"{cost['amount']:.2f} {cost['currency']}"
    if hours and used.get("gpus"):
        return f"{hours:.2g} GPU-h"
    energy = used.get("energy") or {}
    kwh = [v for v in (_number(energy.get("gpu_kwh")), _number(energy.get("cpu_kwh"))) if v is not None]
    return f"{sum(kwh):.2g} kWh" if kwh else "-"


def goodput_cell(figures: Optional[dict[str, Any]]) -> str:
    """The job's effective training time so far (productive / allocated, launcher/contract/records/goodput.py)."""
    pct = _number((figures or {}).get("effective_pct"))
    return "-" if pct is None else f"{pct:.0f}%"


def screen(found: Sequence[Status], width: int) -> list[str]:
    """The table, each line cut to the terminal's width."""
    from meshrun.submit.views.tables import table

    if not found:
        return ["no running jobs (`meshrun status` lists the recent ones)"]
    return [line[:width] for line in table([HEAD, *(row(s) for s in found)]).splitlines()]


def run(
    records: Sequence[Any],
    clusters: Any,
    registry: Any,
    out: Optional[TextIO] = None,
    once: bool = False,
    named: bool = False,
) -> int:
    """Redraw every REFRESH_S until Ctrl-C; not a terminal (or `once`): one refresh as plain lines, of the jobs
    still running (`named`: the jobs the user named, ended or not)."""
    from meshrun.submit import api
    from meshrun.submit.errors import ConnectionLost

    out = out or sys.stdout
    tty = out.isatty() and not once
    while True:
        try:
            found = api.statuses(records, clusters, registry, live=True)
        except ConnectionLost:
            clusters.close()  # the next refresh reconnects
            time.sleep(REFRESH_S)
            continue
        width = shutil.get_terminal_size((200, 50)).columns if tty else 10_000
        if not tty and not named:  # "every running job": one the registry thought running may have ended since
            found = [status for status in found if not status.done]
        lines = screen(found, width)
        if not tty:
            out.write("".join(f"{line}\n" for line in lines))
            return 0
        stamp = time.strftime("%H:%M:%S")
        out.write(
            "\x1b[H\x1b[2J" + "\n".join(lines) + f"\n\nmeshrun top  {stamp}  every {REFRESH_S:.0f} s; Ctrl-C stops\n"
        )
        out.flush()
        time.sleep(REFRESH_S)  # ended jobs stay on screen, as top's do: Ctrl-C leaves
