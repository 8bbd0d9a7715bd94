"""Jobs as text: the status table, a job's detail lines, alerts, losses and the --wait progress line."""

from __future__ import annotations

import time
from typing import Any, Mapping, Optional, Sequence

from meshrun.launcher.contract.nodelist import normalized

DETAIL_ALERTS = 10
"""`status JOB` lists this many of the newest alerts."""


def clock(seconds: Any) -> str:
    """Seconds as H:MM:SS."""
    seconds = int(seconds or 0)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}"


def duration(seconds: Optional[float]) -> str:
    """A time left for a person: H:MM:SS, '-' when unknown, and no absurd hour count for a far estimate."""
    if seconds is None:
        return "-"
    return ">99 days" if seconds >= 100 * 86400 else clock(max(seconds, 0))


def limit_left(status: Any) -> Optional[float]:
    """What the job's time limit leaves it (Slurm ends it then): `left` in --wait's line and in top."""
    if status.done or not status.time_limit_s or status.elapsed_s is None:
        return None
    return float(max(status.time_limit_s - status.elapsed_s, 0))


def finish_in(status: Any, total_steps: Optional[int]) -> Optional[float]:
    """The steps still to train at the current step time: `eta` in --wait's line and in top."""
    step, each = status.progress.get("step"), status.progress.get("step_time_s")
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (step, each))
    if status.done or not total_steps or not numbers:
        return None
    return float(max(total_steps - step, 0) * each)


def table(rows: Sequence[Sequence[str]]) -> str:
    """Columns aligned in terminal cells (a wide or emoji name takes two per character), values printable."""
    from meshrun.submit.textwidth import display_width, ljust, printable

    cells = [[printable(str(c)) for c in row] for row in rows]
    widths = [max(display_width(r[i]) for r in cells) for i in range(len(cells[0]))]
    return "".join("  ".join(ljust(c, w) for c, w in zip(row, widths)).rstrip() + "\n" for row in cells)


def elapsed_cell(status: Any, now: Optional[float] = None) -> str:
    """ELAPSED: H:MM:SS, '-' when unknown; for a job whose cluster cannot be reached now, the value the last
    status that reached it saw, with its age: '0:03:20 (as of 5m ago)'."""
    if status.elapsed_s is None:
        return "-"
    as_of = getattr(status, "elapsed_as_of", None)
    if as_of is None:
        return clock(status.elapsed_s)
    age = int(max((time.time() if now is None else now) - as_of, 0.0))
    return f"{clock(status.elapsed_s)} (as of {age_text(age)} ago)"


def age_text(seconds: int) -> str:
    """How long ago, coarse: 40s, 5m, 3h, 2d."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def status_table(found: Sequence[Any]) -> str:
    notes = [finding_note(s) for s in found]
    noted = any(notes)  # the NOTE column only when a job has something to say: the table stays narrow
    alerted = any(s.alerts for s in found)  # the ALERTS column likewise
    rows = [
        (
            "JOB",
            "CLUSTER",
            "NAME",
            "STATE",
            "STEP",
            "LOSS",
            "RESTARTS",
            "CKPT",
            "ELAPSED",
            *alerted * ("ALERTS",),
            *noted * ("NOTE",),
            "RUN DIR",
        )
    ]
    for s, note in zip(found, notes):
        loss = s.progress.get("loss")
        rows.append(
            (
                s.job_id,
                s.cluster,
                s.name,
                s.state,
                str(s.progress.get("step", "-")),
                f"{loss:.4f}" if isinstance(loss, (int, float)) else "nan" if "loss" in s.progress else "-",
                restarts_cell(s),
                str(s.progress.get("checkpoint_step", "-")),
                elapsed_cell(s),
                *alerted * (alerts_note(s.alerts),),
                *noted * (note or "-",),
                s.run_dir,
            )
        )
    return table(rows)


def restarts_cell(status: Any, short: bool = False) -> str:
    """RESTARTS: Slurm's requeues, then the restarts inside the allocation on spare nodes ('0+1 in job'; `top`'s
    narrow column: '0+1')."""
    if not status.restarts_in_job:
        return str(status.restarts)
    return f"{status.restarts}+{status.restarts_in_job}" + ("" if short else " in job")


def alerts_note(alerts: Sequence[dict[str, Any]]) -> str:
    """The ALERTS cell: how many, and the newest one's rule ("2 loss_spike"); "-" when none."""
    return f"{len(alerts)} {alerts[-1].get('rule')}" if alerts else "-"


def alert_line(alert: dict[str, Any]) -> str:
    """One alert for a person: when, the rule, where, the message."""
    from meshrun.submit.textwidth import printable

    where = "".join(f" {key} {alert[key]}" for key in ("step", "rank", "node") if alert.get(key) is not None)
    return printable(f"{_when(alert.get('time'))} {alert.get('rule')}{where}: {alert.get('message', '')}".strip())


def finding_note(status: Any) -> str:
    """The list view's short marker of what the sidecars found ("" when nothing)."""
    notes = []
    if status.verdict is not None:
        step = status.verdict.get("step")
        notes.append(f"hang at step {step}" if isinstance(step, int) else "hang")
    if status.stragglers:
        notes.append(f"{len(status.stragglers)} straggler{'s' if len(status.stragglers) > 1 else ''}")
    return ", ".join(notes)


def _when(seconds: Any) -> str:
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool):
        return ""
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds))
    except (OverflowError, OSError, ValueError):
        return ""


def _hang_head(verdict: dict[str, Any]) -> str:
    """When the hang was declared, and in which attempt (a requeued job has several); the paragraph says the rest."""
    attempt = verdict.get("attempt")
    parts = [_when(verdict.get("time")), f"attempt {attempt}" if isinstance(attempt, str) and attempt else ""]
    return ", ".join(p for p in parts if p)


def detail_lines(status: Any, width: int = 100) -> list[str]:
    """One job's findings under its table row: why it ended so (or waits), the engine, the hang's verdict,
    stragglers, environment mismatches."""
    import functools
    import textwrap

    from meshrun.submit.textwidth import printable

    # Never broken at a hyphen: an option ('--container-image=...') or a node name stays whole on its line.
    wrap = functools.partial(textwrap.wrap, width=width, break_on_hyphens=False)
    lines = wrap(printable(_reason_line(status)), subsequent_indent="  ") if status.reason else []
    lines += [f"engine: {printable(status.engine)}"] if status.engine else []
    lines += [printable(f"chosen: {status.chosen}")] if status.chosen else []
    ratio = status.progress.get("plan_step_ratio")
    if isinstance(ratio, (int, float)) and not isinstance(ratio, bool):  # launcher/train/plancheck.py's
        term = status.progress.get("plan_term")
        lines.append(printable(f"vs plan: step time {ratio:.2f}x the plan's ({term} furthest off)"))
    if status.verdict is not None:
        lines.append(printable(f"hang: {_hang_head(status.verdict)}".rstrip(": ")))
        paragraph = printable(" ".join(str(status.verdict.get("verdict") or "").split()))
        lines += wrap(paragraph, initial_indent="  ", subsequent_indent="  ")
        lines.append(f"  the diagnosis: meshrun logs {status.job_id} --diagnosis")
    if status.stragglers:
        named = [
            f"rank {s['rank']} ({s.get('node', '?')}) {float(s['ratio']):.1f}x"
            + (" the median busy time" if not i else "")
            for i, s in enumerate(status.stragglers)
        ]
        lines.append(printable("stragglers: " + ", ".join(named)))
    lines += [printable(f"environment: {line}") for line in status.env_mismatches]
    if status.best_checkpoint is not None:
        best = status.best_checkpoint
        lines.append(
            f"best checkpoint: step {best['step']}, val_loss {best['val_loss']:.4f} "
            f"(meshrun export {status.job_id} --best)"
        )
    if status.goodput is not None:
        lines.append(goodput_line(status.goodput, trainer=status.steps is not None, ended=status.done))
    if status.usage is not None:
        from meshrun.submit.core.usage import usage_line

        lines.append(usage_line(status.usage))
    if status.run_goodput is not None:
        lines.append(run_goodput_line(status.run_goodput, trainer=status.steps is not None))
    if status.alerts:
        lines.append(f"alerts ({len(status.alerts)} recent, newest last; all: {status.run_dir}/alerts.jsonl):")
        lines += [f"  {alert_line(a)}" for a in status.alerts[-DETAIL_ALERTS:]]
    return lines


GOODPUT_WORDS = {"setup": "setup", "lost": "lost", "ckpt_stall": "checkpoint stall", "eval": "eval", "end": "end"}


def span(seconds: float) -> str:
    """A part of a job's time, short: 0.3s, 42.0s, 3m07s, 2h05m."""
    if seconds < 59.95:  # what rounds to 60.0s is 1m00s
        return f"{seconds:.1f}s"
    if seconds < 3599.5:
        whole = round(seconds)  # rounded as sacct's elapsed time is, not cut: 60.98 s is 1m01s
        return f"{whole // 60}m{whole % 60:02d}s"
    minutes = round(seconds / 60)
    return f"{minutes // 60}h{minutes % 60:02d}m"


def _of_the_wall(figures: Mapping[str, Any]) -> str:
    """'; 68% of the 7m58s since the first start': the share of what the user waited, where requeue gaps make it
    differ from the allocated share ('' otherwise, and in records older than the figure)."""
    pct, wall = figures.get("wall_effective_pct"), figures.get("wall_s")
    if pct is None or not wall or not figures.get("requeue_s"):
        return ""
    return f"; {pct:.0f}% of the {span(float(wall))} since the first start"


def run_goodput_line(run: Mapping[str, Any], trainer: bool = True) -> str:
    """'the run dir's 2 jobs: 64% effective (productive 52.1s of 81.4s allocated, 9 steps lost)': the run dir's
    total (submit/core/findings.py's run_total). `trainer` False with nothing productive: a `command:` program
    that reports no steps, whose allocation is all that is measured (as its job's own line says)."""
    head = f"the run dir's {run['jobs']} jobs"
    allocated = span(float(run["allocated_s"]))
    if not trainer and not run.get("productive_s"):
        return f"{head}: goodput not measured ({allocated} allocated): the program reports no steps"
    return (
        f"{head}: {run.get('effective_pct') or 0:.0f}% effective (productive "
        f"{span(float(run['productive_s']))} of {allocated} allocated"
        + (f", {run['lost_steps']} steps lost" if run.get("lost_steps") else "")
        + ")"
    )


def goodput_line(figures: Mapping[str, Any], trainer: bool = True, ended: bool = False) -> str:
    """'goodput: 81% effective (productive 9m45s of 12m03s allocated; setup 40.2s, lost 1m02s (37 steps), ...);
    queued 3.1s, requeue 45.0s': launcher/contract/records/goodput.py's record, in one line. `trainer` False: a
    `command:` job, whose program may report no step at all (then only the allocation is measured). `ended`:
    the scheduler says the job ended, whatever its record (one its end never reached, e.g. a killed job's)."""
    parts = figures.get("parts_s") or {}
    pct = figures.get("effective_pct")
    running = bool(figures.get("running")) and not ended
    head = "goodput so far" if running else "goodput"
    if not figures.get("steps") and not parts.get("productive") and not trainer:
        # A program that reports no step (a framework's own loop): its whole allocation would read as setup.
        allocated = figures.get("allocated_s")
        held = f" ({span(allocated)} allocated in {len(figures.get('attempts') or ())} start(s))" if allocated else ""
        return (
            f"{head}: not measured{held}: the program reports no steps "
            "(meshrun.launcher.job.report(step) in its loop gives the split: setup, productive, lost)"
        )
    if pct is None:  # the record of a start that has not run a second yet (a running job refreshes it each minute)
        if not running:
            return f"{head}: not measured (the job ended before its first second of work was recorded)"
        return f"{head}: not measured yet (a running job's record is refreshed each minute)"
    rest = [
        f"{word} {span(parts[key])}" + (f" ({figures.get('lost_steps')} steps)" if key == "lost" else "")
        for key, word in GOODPUT_WORDS.items()
        if parts.get(key, 0) >= 0.05
    ]
    waits = [
        f"{word} {span(figures[key])}"
        for key, word in (("queue_s", "queued"), ("requeue_s", "requeue"))
        if figures.get(key)
    ]
    attempts = list(figures.get("attempts") or ())
    starts = len(attempts)
    moves = [
        f"{normalized(str(before.get('nodes')))} -> {normalized(str(after.get('nodes')))}"
        for before, after in zip(attempts, attempts[1:])
        if after.get("in_job") and normalized(str(before.get("nodes"))) != normalized(str(after.get("nodes")))
    ]
    in_job = sum(1 for a in attempts if a.get("in_job"))
    if in_job:  # restarts inside an allocation (spare nodes) apart from Slurm's requeues
        waits.append(f"{in_job} restart(s) inside the allocation" + (f" ({', '.join(moves)})" if moves else ""))
    return (
        f"{head}: {pct if pct is not None else 0:.0f}% effective (productive {span(parts.get('productive', 0))} of "
        f"{span(float(figures.get('allocated_s') or 0))} allocated"
        + (f" in {starts} starts" if starts > 1 else "")
        + (f"; {', '.join(rest)}" if rest else "")
        + ")"
        + _of_the_wall(figures)
        + (f"; {', '.join(waits)}" if waits else "")
    )


def _reason_line(status: Any) -> str:
    """'reason (exit 2, bad input): ...': the job's own words for its state, with its exit code's meaning."""
    from meshrun.launcher.contract.exitcodes import EXIT_NAMES

    code = status.exit_code
    name = EXIT_NAMES.get(code, "") if code else ""
    if name and str(status.reason).startswith(name.split(" (")[0]):
        name = ""  # the reason says it already ('gave up (crash loop: ...)'): not twice
    named = f" (exit {code}, {name})" if name else (f" (exit {code})" if code else "")
    return f"reason{named}: {status.reason}"


def progress_line(status: Any, total_steps: Optional[int]) -> str:
    parts = [f"[{status.state}]"]
    step = status.progress.get("step")
    if step is not None:
        parts.append(f"step {step}/{total_steps}" if total_steps else f"step {step}")
    if "loss" in status.progress:
        parts.append(f"loss {loss_text(status.progress['loss'])}")
    if "val_loss" in status.progress:
        at = status.progress.get("val_step")
        parts.append(f"val_loss {loss_text(status.progress['val_loss'])}" + (f" (step {at})" if at is not None else ""))
    if status.elapsed_s is not None:
        parts.append(f"elapsed {elapsed_cell(status)}")
    if (eta := finish_in(status, total_steps)) is not None:
        parts.append(f"eta {duration(eta)}")
    if (left := limit_left(status)) is not None:
        parts.append(f"left {duration(left)}" + (" (the limit comes first)" if eta is not None and eta > left else ""))
    if status.reason and not status.done:
        parts.append(f"({status.reason})")
    return " ".join(parts)


def loss_text(loss: Any) -> str:
    """A loss for a person: a diverged job writes null (strict JSON has no NaN), shown as nan."""
    if isinstance(loss, (int, float)) and not isinstance(loss, bool):
        return f"{loss:.4f}"
    return "nan" if loss is None else "-"
