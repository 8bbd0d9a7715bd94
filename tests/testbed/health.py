"""The testbed's health between tests: leftover jobs cleared when a session starts, and a node that went DOWN
(its slurmd died, Slurm drained it) brought back before the next test, so that one casualty does not fail
every later test.

    claim = claim_session()      # at session start: True when no other session uses this testbed
    clear_leftover_jobs()        # only then: jobs an interrupted earlier session left queued or running
    heal()                       # before each test: one sinfo call when all is well

Stdlib only, like testbed.py.
"""

from __future__ import annotations

import fcntl
from typing import IO, Optional

from tests.testbed import testbed as tb

HEAL_WAIT_S = 30.0
"""How long heal() waits for a restarted slurmd to register and its node to take jobs again."""

_claim: Optional[IO[str]] = None  # held open (and locked) for the life of the session that claimed it


def claim_session() -> bool:
    """Join the sessions using this testbed (a shared lock held until this process exits); True when no other
    session holds it, i.e. every job in the testbed was left by a session that is gone."""
    global _claim
    if _claim is None:
        _claim = open(tb.TESTBED_DIR / ".sessions", "w")
    try:
        fcntl.flock(_claim, fcntl.LOCK_EX | fcntl.LOCK_NB)
        alone = True
    except BlockingIOError:
        alone = False
    fcntl.flock(_claim, fcntl.LOCK_SH)  # from now on other sessions see this one
    return alone


def clear_leftover_jobs(timeout_s: float = 30.0) -> list[str]:
    """Cancel every job in the testbed's queue (call only after claim_session() returned True); returns them
    as 'ID NAME STATE' lines. A job requeued by an interrupted session would otherwise hold the nodes and
    be started again and again under the next session's tests."""
    res = tb._client("squeue", "-h", "-o", "%A %j %T")
    jobs = [line.strip() for line in res.stdout.splitlines() if line.strip()]
    if jobs:
        tb._cancel_all_jobs(timeout_s)
    return jobs


def node_states() -> dict[str, str]:
    """sinfo's state of each testbed node ({} when slurmctld does not answer)."""
    return tb._node_states()


def healthy(states: dict[str, str]) -> bool:
    return bool(states) and all(states.get(n) in tb._USABLE_STATES for n in tb.NODES)


def heal() -> list[str]:
    """Make the testbed usable again if it is not: restart a daemon that died (its log's last lines say
    how), resume a node Slurm set DOWN or DRAIN. Returns what was done, one line each ([] when it was
    healthy: the daemons' pid files and one sinfo call). Raises tb.TestbedError when it cannot be healed.

    The daemons are checked first: a slurmd that just died still shows `idle` for SlurmdTimeout (300 s)."""
    if all(tb._alive(d) for d in tb._daemons()) and healthy(node_states()):
        return []
    done: list[str] = []
    with tb._locked():
        for d in tb._daemons():
            if not tb._alive(d):
                tail = tb._log_tails(d.logs, lines=5).strip()
                tb._ensure(d)
                done.append(f"restarted {d.name} (it was not running){': ' + tail if tail else ''}")
        states = node_states()
        for node in tb.NODES:
            state = states.get(node, "")
            if state not in tb._USABLE_STATES:
                tb._client("scontrol", "update", f"NodeName={node}", "State=RESUME")
                done.append(f"resumed node {node} (it was {state or 'unknown'})")
        if not tb._wait_until(lambda: healthy(node_states()), HEAL_WAIT_S):
            raise tb.TestbedError(f"testbed: could not heal it: nodes {node_states()} after {'; '.join(done)}")
    return done
