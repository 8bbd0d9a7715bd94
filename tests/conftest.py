"""Fixtures every test folder shares."""

from __future__ import annotations

import shutil
import signal
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from tests import hygiene


def pytest_configure(config: pytest.Config) -> None:
    """A SIGTERM to the test run (a CI timeout, a `kill`) ends it as Ctrl-C does, so every finalizer still
    runs: the servers and processes the tests started are stopped by their pids, not left running."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, interrupt)
    # Every process the tests start carries this run's mark (tests/hygiene.py): what it leaves is found.
    config.stash[_MARK] = hygiene.mark_session(str(config.rootpath))


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
    from launcher.data.corpus import build_corpus

    path = Path("~/.cache/meshrun/data/stdlib.u16").expanduser()
    if not path.is_file():
        build_corpus(path, max_bytes=2_000_000)
    return path


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Under pytest-xdist (scripts/test.sh): the testbed's test files on one worker (tests/xdistgroups.py)."""
    from tests.xdistgroups import TestbedScheduling

    return TestbedScheduling(config, log)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~180k byte tokens from the stdlib's logging package: small, stable, on every machine."""
    import sysconfig

    from launcher.data.corpus import build_corpus

    out = tmp_path_factory.mktemp("corpus") / "logging.u16"
    build_corpus(out, roots=[Path(sysconfig.get_paths()["stdlib"]) / "logging"])
    return out
