"""Process hygiene for the test suite: every process a test session starts carries the session's mark in its
environment, so that (1) a session refuses to start beside processes an earlier, killed session of this
checkout left running (a TensorBoard server, a rank, a supervisor), naming them, and (2) a session stops what
its own tests left running when it ends, interrupted or not.

The mark is MESHRUN_TEST_SESSION=PID:START (the pytest process, meshrun.launcher.contract.procs' exact start time) with
MESHRUN_TEST_CHECKOUT=<repo root>. A process is a stray only when its session is gone: processes of a live
session (another person's run of the same checkout on this machine) are never named, let alone signalled.
Processes under a slurmstepd are the testbed's jobs: the testbed clears those itself (tests/testbed/health.py).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Optional

import psutil

from meshrun.launcher.contract import procs

SESSION_ENV = "MESHRUN_TEST_SESSION"
CHECKOUT_ENV = "MESHRUN_TEST_CHECKOUT"
ALLOW_ENV = "MESHRUN_TEST_ALLOW_STRAYS"
STOP_GRACE_S = 5.0
"""How long a leftover gets after SIGTERM before SIGKILL."""


@dataclass(frozen=True)
class Marked:
    """A live process that carries a test session's mark."""

    identity: procs.Identity
    session: str
    parent: int
    command: str
    test: str
    """The test that started it (pytest's PYTEST_CURRENT_TEST when it did), or ''."""


def mark_session(checkout: str) -> str:
    """Mark this process (the pytest run) and so every process it starts; returns the mark."""
    me = procs.own_identity()
    mark = f"{me.pid}:{me.started_at!r}"
    os.environ[SESSION_ENV] = mark
    os.environ[CHECKOUT_ENV] = checkout
    return mark


def session_alive(mark: str) -> bool:
    """Whether the pytest run that set `mark` still runs."""
    pid, _, started = mark.partition(":")
    try:
        return procs.same_process(int(pid), float(started))
    except ValueError:
        return False


def _under_slurmstepd(proc: psutil.Process) -> bool:
    try:
        return any(parent.name() == "slurmstepd" for parent in proc.parents())
    except psutil.Error:
        return False


def marked(checkout: str) -> list[Marked]:
    """Every live process of this machine (readable by this user) marked by a session of `checkout`."""
    found = []
    for proc in psutil.process_iter():
        try:
            env = proc.environ()
            if env.get(CHECKOUT_ENV) != checkout or SESSION_ENV not in env:
                continue
            if proc.status() == psutil.STATUS_ZOMBIE or _under_slurmstepd(proc):
                continue
            identity = procs.process_identity(proc.pid)
            if identity is None:
                continue
            command = " ".join(proc.cmdline())
            test = env.get("PYTEST_CURRENT_TEST", "")
            found.append(Marked(identity, env[SESSION_ENV], proc.ppid(), command, test))
        except (psutil.Error, OSError):
            continue  # gone meanwhile, or not ours to read
    return found


def strays(checkout: str) -> list[Marked]:
    """Processes an earlier session of `checkout` left running after it ended: the outermost of each tree
    (a stray's children are stopped with it)."""
    gone = [m for m in marked(checkout) if not session_alive(m.session)]
    pids = {m.identity.pid for m in gone}
    return [m for m in gone if m.parent not in pids]


def describe(found: list[Marked]) -> str:
    lines = []
    for m in found:
        session = f"test session {m.session.split(':')[0]}"
        by = f"{m.test.rsplit(' ', 1)[0]} in {session}" if m.test else session
        lines.append(f"  pid {m.identity.pid} (started by {by}): {m.command[:200]}")
    return "\n".join(lines)


def refusal(checkout: str) -> Optional[str]:
    """The message a session starts with when an earlier one left processes running, else None."""
    if os.environ.get(ALLOW_ENV) == "1":
        return None
    found = strays(checkout)
    if not found:
        return None
    pids = " ".join(str(m.identity.pid) for m in found)
    return (
        f"{len(found)} process(es) left running by an earlier test session of {checkout} that is gone "
        f"(a killed run): tests beside them fail in confusing ways (ports, load, TensorBoard servers).\n"
        f"{describe(found)}\nStop them (`kill {pids}`), or run anyway with {ALLOW_ENV}=1."
    )


def leftovers(mark: str, checkout: str) -> list[Marked]:
    """This session's processes still running (not this process nor its ancestors)."""
    me = os.getpid()
    ancestors = {p.pid for p in psutil.Process(me).parents()}
    return [
        m for m in marked(checkout) if m.session == mark and m.identity.pid != me and m.identity.pid not in ancestors
    ]


def stop(found: list[Marked], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM each (only while its pid still names it), then SIGKILL what is left after `grace_s`."""
    for m in found:
        try:
            procs.signal_if_same(m.identity, signal.SIGTERM)
        except PermissionError:
            continue
    deadline = time.monotonic() + grace_s
    while any(procs.alive(m.identity) for m in found) and time.monotonic() < deadline:
        time.sleep(0.1)
    for m in found:
        if procs.alive(m.identity):
            try:
                procs.signal_if_same(m.identity, signal.SIGKILL)
            except PermissionError:
                continue
