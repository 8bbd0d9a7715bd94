"""What the TensorBoard tests share: a second real Unix user on this machine, a browser that keeps the
board's cookie, and stopping every tbserve server a test started, by pid (checked by start time first).

Both ends run on this machine (the laptop is the test, the login node is the testbed's sshd), so a
user other than the one running the tests stands for "another user of the login node" and for
"another user of your laptop" at once.
"""

from __future__ import annotations

import http.cookiejar
import json
import os
import pwd
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Iterable, Optional

import pytest

from meshrun.submit.views import tbserve

OTHER_USER = os.environ.get("MESHRUN_TEST_OTHER_USER", "meshrun-peer")
"""A second real user (created on first use, as `useradd` would for any new colleague)."""


def other_user() -> str:
    """The second user's name: created if missing; the test is skipped when this machine cannot run as it."""
    if os.geteuid() != 0:
        pytest.skip("running a command as a second Unix user needs root (runuser)")
    try:
        pwd.getpwnam(OTHER_USER)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", OTHER_USER],
            check=True,
            capture_output=True,
        )
    return OTHER_USER


def as_other(*argv: str, timeout: float = 30) -> subprocess.CompletedProcess:
    """Run argv as the second user (its own uid and groups, no root left), in a folder it may read."""
    return subprocess.run(
        ["runuser", "-u", other_user(), "--", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd="/",
    )


def http_code_as_other(url: str) -> tuple[int, str]:
    """(HTTP status, body) of a GET by the second user with curl (0: nothing answered)."""
    out = as_other("curl", "-s", "-m", "10", "-w", "\n%{http_code}", url)
    body, _, code = out.stdout.rpartition("\n")
    return int(code or 0), body


def split_url(url: str) -> tuple[str, str]:
    """`http://127.0.0.1:P/?token=T` -> ('http://127.0.0.1:P/', 'T') ('' when the URL carries none)."""
    parts = urllib.parse.urlsplit(url)
    token = dict(urllib.parse.parse_qsl(parts.query)).get("token", "")
    return f"{parts.scheme}://{parts.netloc}/", token


class Browser:
    """The owner's browser: opens the printed URL once (the server sets its cookie), then asks the board."""

    def __init__(self, url: str) -> None:
        self.base, _ = split_url(url)
        self.jar = http.cookiejar.CookieJar()
        self.opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(self.jar))
        with self.opener.open(url, timeout=10) as answer:  # the token URL: a redirect that sets the cookie
            answer.read()

    def get(self, path: str) -> Any:
        """JSON at base+path; None while TensorBoard is still loading (a tag may not exist yet: HTTP 400)."""
        try:
            with self.opener.open(self.base + path, timeout=10) as answer:
                return json.loads(answer.read())
        except (urllib.error.URLError, ConnectionError):
            return None

    def losses(self, run: str) -> list[tuple[int, float]]:
        query = urllib.parse.urlencode({"run": run, "tag": "loss"})
        return [(step, value) for _, step, value in self.get(f"data/plugin/scalars/scalars?{query}") or []]


def until(what: str, probe: Any, timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        assert time.monotonic() < deadline, f"TensorBoard never showed {what}"
        time.sleep(0.3)


# ------------------------------------------------------------------ servers, by pid


def meshrun_tb(home: Path, *jobs: str) -> subprocess.Popen[str]:
    """`meshrun tb JOB...` as a user in HOME runs it, its output piped (the URL is its first line)."""
    from tests.helpers.cli import REPO, env_for

    argv = [sys.executable, "-m", "meshrun.submit.cli.main", "tb", *jobs]
    return subprocess.Popen(
        argv, cwd=REPO, text=True, env=env_for(home), stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


start_time = tbserve.start_time
"""The kernel's start time of a live (not zombie) process, None once it is gone: the product's own check."""


def servers(keys: Iterable[str] = (), under: Iterable[Path] = ()) -> dict[int, int]:
    """pid -> start time of every `tbserve.py serve STATE` process whose state dir is named by one of keys
    (the runs' digest: tbserve.state_dir(runs).name) or lies under one of the folders (a test's HOME)."""
    wanted = {os.fsencode(k) for k in keys}
    homes = [os.fsencode(str(folder)) + b"/" for folder in under]
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().rstrip(b"\0").split(b"\0")
        except OSError:
            continue
        for i, arg in enumerate(argv[:-2]):
            state = argv[i + 2]
            if arg.endswith(b"tbserve.py") and argv[i + 1] == b"serve":
                if os.path.basename(state) in wanted or any(state.startswith(home) for home in homes):
                    started = start_time(int(proc.name))
                    if started is not None:
                        found[int(proc.name)] = started
    return found


class Cleanup:
    """What a test serves: its servers are stopped by pid when it ends (the `tb_cleanup` fixture)."""

    def __init__(self) -> None:
        self.keys: list[str] = []
        self.under: list[Path] = []

    def runs(self, runs: list[tuple[str, Path]]) -> None:
        """A `meshrun tb` of these (label, run dir) pairs, in the order meshrun lists them."""
        from meshrun.submit.views import tbserve

        self.keys.append(tbserve.state_dir([(label, Path(path)) for label, path in runs]).name)

    def stop(self) -> None:
        stop(servers(self.keys, self.under))


def stop(found: dict[int, int]) -> None:
    """Stop these servers by pid, each only while it is still the process first seen (same start time)."""
    for pid, started in found.items():
        if start_time(pid) == started:
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while any(start_time(pid) == started for pid, started in found.items()) and time.monotonic() < deadline:
        time.sleep(0.1)


def gone(pid: int, started: Optional[int], timeout: float = 30) -> bool:
    """The process (pid at that start time) ended within timeout."""
    deadline = time.monotonic() + timeout
    while start_time(pid) == started and started is not None:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True
