"""Integration-test fixtures: the real Slurm cluster + sshd testbed of tests/testbed/testbed.py.

A test that needs the cluster requests the `testbed` fixture; it is then marked `slurm` too, so
`pytest -m "not slurm"` deselects it. The testbed is started once per session and stopped at its
end, unless MESHRUN_TESTBED_KEEP=1 (handy while iterating: the next session's up() takes ~0.3 s).
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Iterator

import pytest

from tests import xdistgroups
from tests.testbed import health
from tests.testbed import testbed as tb


@pytest.fixture(scope="session")
def testbed() -> Iterator[dict[str, object]]:
    """Start the testbed (or find it running), export SLURM_CONF, yield testbed.info()."""
    missing = tb.missing_binaries()
    if missing:
        # Fail, never skip: a skipped integration suite looks green while testing nothing.
        pytest.fail(
            f"the Slurm testbed needs {', '.join(missing)}: run `sh tests/testbed/install.sh` as root first",
            pytrace=False,
        )
    # A testbed someone else started (another pytest session, a developer's `up`) is theirs
    # to stop: this session only stops what it started.
    already_up = all(pid is not None for pid in tb.status().values())
    try:
        info = tb.up()
        # Jobs left by an interrupted earlier session (requeued, they would start again and again under
        # this session's tests); only when no other session uses this testbed now.
        cleared = health.clear_leftover_jobs() if health.claim_session() else []
    except tb.TestbedError as e:
        pytest.fail(str(e), pytrace=False)
    if cleared:
        warnings.warn(
            f"testbed: cancelled {len(cleared)} job(s) an earlier session left: {'; '.join(cleared)}", stacklevel=1
        )
    with pytest.MonkeyPatch.context() as mp:
        # Code under test (sbatch, submitit...) finds the cluster the way it would on a real one.
        for key, value in tb.client_env().items():
            mp.setenv(key, value)
        # cluster_configs/testbed.yaml activates this venv on the nodes (its `setup` line).
        mp.setenv("MESHRUN_TESTBED_VENV", sys.prefix)
        try:
            yield info
        finally:
            if os.environ.get("MESHRUN_TESTBED_KEEP") != "1" and not already_up:
                tb.down()


@pytest.fixture(autouse=True)
def healthy_testbed(request: pytest.FixtureRequest) -> None:
    """Before each test that uses the testbed: it is healthy (its daemons run, one sinfo says both nodes
    take jobs), else it is healed first (a dead daemon restarted, a DOWN or DRAIN node resumed) and the
    warning says what happened: one casualty must not fail every later test."""
    if "testbed" not in request.fixturenames:
        return
    request.getfixturevalue("testbed")
    try:
        healed = health.heal()
    except tb.TestbedError as e:
        pytest.fail(str(e), pytrace=False)
    if healed:
        warnings.warn(f"testbed healed before {request.node.name}: {'; '.join(healed)}", stacklevel=1)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the testbed's tests `slurm`; and check that tests/xdistgroups.py, which keeps every test
    that reaches the testbed on one worker by its file's source, sees each of them (else two workers
    would share the one testbed, and fail in confusing ways)."""
    for item in items:
        if "testbed" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slurm)
            if not xdistgroups.in_testbed_group(item.nodeid):
                raise pytest.UsageError(f"tests/xdistgroups.py does not see {item.nodeid} reach the testbed")


@pytest.fixture
def tb_cleanup() -> Iterator[object]:
    """Every TensorBoard server a test starts is stopped by pid when it ends, passed or failed or
    interrupted (Ctrl-C runs finalizers): name its runs with `tb_cleanup.runs([(job, run_dir)])`, or its
    HOME with `tb_cleanup.under.append(home)` (a `meshrun tb` on this machine keeps its state there)."""
    from tests.helpers.tbhelp import Cleanup

    cleanup = Cleanup()
    try:
        yield cleanup
    finally:
        cleanup.stop()
