"""Fixtures every test folder shares, the real Slurm cluster + sshd testbed of tests/testbed/testbed.py among them.

A test that needs the cluster requests the `testbed` fixture; it is then marked `slurm` too, so
`pytest -m "not slurm"` deselects it. The testbed is started once per session and stopped at its
end, unless MESHRUN_TESTBED_KEEP=1 (handy while iterating: the next session's up() takes ~0.3 s).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Iterator

import pytest

from meshrun.launcher.contract.records import suspects
from tests import hygiene, xdistgroups
from tests.testbed import health
from tests.testbed import testbed as tb


def pytest_configure(config: pytest.Config) -> None:
    """A SIGTERM to the test run (a CI timeout, a `kill`) ends it as Ctrl-C does, so every finalizer still
    runs: the servers and processes the tests started are stopped by their pids, not left running."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, interrupt)
    # A run started in the background of a script (`cmd &` without job control) inherits SIGINT ignored, and so
    # would every process the tests start: the Ctrl-C tests (`submit --wait`, `tb`) would wait out their
    # timeouts. A handler here is reset to the default in each child at exec, as a terminal's processes have it.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # Every process the tests start carries this run's mark (tests/hygiene.py): what it leaves is found.
    config.stash[_MARK] = hygiene.mark_session(str(config.rootpath))
    if _runs_tests(config):
        # The tests' own torch work (the unit tests' models and checkpoints, the doctor's GEMM) on one thread, as
        # every rank they start has (cpus_per_task 1): torch's default, a thread per core, spins in OpenMP's
        # barriers while the suite's other workers hold the cores (tests/unit on 2 cores, 3 workers: 74 -> 60 s
        # of CPU). The processes the tests start are not touched: their threads are what the product sets.
        import torch

        torch.set_num_threads(1)


def _runs_tests(config: pytest.Config) -> bool:
    """Whether this process runs tests: an xdist worker, or a run without workers (not xdist's controller)."""
    return bool(os.environ.get("PYTEST_XDIST_WORKER")) or not getattr(config.option, "numprocesses", None)


_MARK = pytest.StashKey[str]()


def pytest_sessionstart(session: pytest.Session) -> None:
    """Refuse to run beside processes an earlier, killed run of this checkout's tests left running."""
    message = hygiene.refusal(str(session.config.rootpath))
    if message:
        pytest.exit(message, returncode=pytest.ExitCode.USAGE_ERROR)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Stop, by pid and start time, whatever this run's tests left running (after every finalizer ran;
    a SIGTERM to the run gets here too), and name it: each is a test's leak to fix."""
    from tests.helpers import zygote

    zygote.close()  # the rank server is the session's own, not a test's leak
    config = session.config
    left = hygiene.leftovers(config.stash[_MARK], str(config.rootpath))
    if not left:
        return
    hygiene.stop(left)
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.ensure_newline()
        reporter.write_line(f"stopped {len(left)} process(es) the tests left running:\n{hygiene.describe(left)}")


@pytest.fixture
def canary() -> Iterator[Path]:
    """A file that a shell-injection probe would create: each test its own, so no test sees another's
    leftover. Short (job names hold at most 128 characters) and absolute, so that a job running in
    any folder of this machine, the testbed's included, would create this very file."""
    folder = Path(tempfile.mkdtemp(prefix="pwn-"))
    try:
        yield folder / "p"
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def default_corpus() -> Path:
    """The examples' token file (data.path's default, ~/.cache/meshrun/data/stdlib.u16), built as README's
    quick start builds it when this machine has none yet: a submit of an example as shipped (a dry run
    too) refuses a missing token file."""
    from meshrun.launcher.data.corpus import build_corpus

    path = Path("~/.cache/meshrun/data/stdlib.u16").expanduser()
    if not path.is_file():
        build_corpus(path, max_bytes=2_000_000)
    return path


TIMELINE_ENV = "MESHRUN_TEST_TIMELINE"
"""A folder: each worker appends `worker<TAB>start<TAB>end<TAB>test id` for every test it runs (setup and teardown
included), to find what keeps the suite's last worker busy (CI's time is the slowest worker's)."""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: object) -> Iterator[None]:
    folder = os.environ.get(TIMELINE_ENV)
    started = time.time()
    yield
    if folder:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(os.path.join(folder, f"{worker}.tsv"), "a", encoding="utf-8") as handle:
            handle.write(f"{worker}\t{started:.2f}\t{time.time():.2f}\t{item.nodeid}\n")


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Under pytest-xdist (scripts/test.sh): each file of testbed tests on one worker, with its own testbed
    (tests/xdistgroups.py)."""
    from tests.xdistgroups import TestbedScheduling

    return TestbedScheduling(config, log)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~180k byte tokens from the stdlib's logging package: small, stable, on every machine."""
    import sysconfig

    from meshrun.launcher.data.corpus import build_corpus

    out = tmp_path_factory.mktemp("corpus") / "logging.u16"
    build_corpus(out, roots=[Path(sysconfig.get_paths()["stdlib"]) / "logging"])
    return out


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


WATCHED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


@pytest.fixture(autouse=True)
def signals_left_as_found() -> Iterator[None]:
    """A test that leaves the worker's signals blocked, ignored or handled otherwise than it found them passes that
    on to every process the later tests of its worker start (a mask and an ignored signal survive exec): once, a
    sidecar main() called in-process left TERM blocked, and two unrelated tests failed minutes later on that worker
    (a cancel that did not stop a job, a `kill -TERM` a shell never heard). The test that did it fails instead."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, ())
    handlers = {sig: signal.getsignal(sig) for sig in WATCHED_SIGNALS}
    yield
    now_mask = signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    changed = [
        f"{signal.Signals(sig).name} handler" for sig in WATCHED_SIGNALS if signal.getsignal(sig) != handlers[sig]
    ]
    for sig, handler in handlers.items():
        signal.signal(sig, handler)
    changed += [f"{s.name} {'blocked' if s in now_mask else 'unblocked'}" for s in set(mask) ^ set(now_mask)]
    if changed:
        pytest.fail(f"the test left this process's signals changed: {', '.join(sorted(changed))}", pytrace=False)


@pytest.fixture(autouse=True)
def healthy_testbed(request: pytest.FixtureRequest) -> None:
    """Before each test that uses the testbed: it is healthy (its daemons run, one sinfo says both nodes
    take jobs), else it is healed first (a dead daemon restarted, a DOWN or DRAIN node resumed) and the
    warning says what happened: one casualty must not fail every later test."""
    if "testbed" not in request.fixturenames:
        return
    request.getfixturevalue("testbed")
    # Each test starts with no suspect nodes: a hang test's verdict must not keep nodes from later tests' jobs.
    for work in ("work", "work-ssh"):
        (tb.TESTBED_DIR / work / suspects.LEDGER).unlink(missing_ok=True)
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
