"""The gate in front of TensorBoard (tbserve.Gate) and the helper's checks before it signals a pid, without
a server: the WSGI app is a stub. The real server, a second Unix user and sshd are in
tests/integration/test_tensorboard_privacy.py and test_ssh_loopback.py."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from meshrun.submit.views import tbserve

TOKEN = tbserve.new_token()
COOKIE = tbserve.COOKIE_PREFIX + hashlib.sha256(TOKEN.encode()).hexdigest()[:12]


def _ask(path: str = "/", query: str = "", cookie: str = "") -> tuple[str, dict[str, str], bytes, bool]:
    """(status, headers, body, reached TensorBoard?) of one request through the gate."""
    reached: list[bool] = []

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        reached.append(True)
        start_response("200 OK", [("Content-Type", "application/json")])
        return [b'{"run": [1, 2, 3]}']

    answer: dict[str, Any] = {}

    def start_response(status: str, headers: list[tuple[str, str]]) -> None:
        answer["status"], answer["headers"] = status, dict(headers)

    environ = {"PATH_INFO": path, "SCRIPT_NAME": "", "QUERY_STRING": query, "HTTP_COOKIE": cookie}
    body = b"".join(tbserve.Gate(app, TOKEN)(environ, start_response))
    return answer["status"], answer["headers"], body, bool(reached)


def test_the_token_url_sets_the_cookie_and_leaves_the_address_bar() -> None:
    status, headers, body, reached = _ask("/data/plugin/scalars/scalars", f"run=7&token={TOKEN}&tag=loss")
    assert status.startswith("302") and not reached and body == b""
    assert headers["Location"] == "/data/plugin/scalars/scalars?run=7&tag=loss"
    assert headers["Set-Cookie"] == f"{COOKIE}={TOKEN}; Path=/; HttpOnly; SameSite=Lax"
    assert _ask("/", f"token={TOKEN}")[1]["Location"] == "/"
    assert _ask("//elsewhere.example/x", f"token={TOKEN}")[1]["Location"] == "/elsewhere.example/x"  # not off-site


def test_the_cookie_lets_a_request_through_and_nothing_else_does() -> None:
    assert _ask("/data/runs", cookie=f"{COOKIE}={TOKEN}")[3]
    # Another server's cookie beside this one (cookies do not tell 127.0.0.1's ports apart): each reads its own.
    assert _ask("/data/runs", cookie=f"meshrun-tb-000000000000=other; {COOKIE}={TOKEN}")[3]
    refused = [
        _ask("/data/runs"),
        _ask("/data/runs", query="token="),
        _ask("/data/runs", query=f"token={TOKEN[:-1]}"),
        _ask("/data/runs", query=f"token={TOKEN}x"),
        _ask("/data/runs", cookie=f"{COOKIE}={TOKEN[::-1]}"),
        _ask("/data/runs", cookie=f"meshrun-tb-000000000000={TOKEN}"),  # the right secret under another name
        _ask("/data/runs", cookie='bad"cookie; ==; \x00'),
    ]
    for status, _, body, reached in refused:
        assert status.startswith("403") and not reached and b"run" not in body.replace(b"meshrun", b"")


def test_tokens_are_long_random_and_url_safe() -> None:
    tokens = {tbserve.new_token() for _ in range(100)}
    assert len(tokens) == 100
    assert all(
        len(t) == 43 and set(t) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")
        for t in tokens
    )


def test_a_pid_is_signalled_only_while_it_is_that_server(tmp_path: Path) -> None:
    state = tmp_path / "KEY"
    me = os.getpid()
    assert tbserve.start_time(me) is not None
    assert not tbserve.is_server(me, tbserve.start_time(me), state)  # alive, but not `tbserve.py serve STATE`
    fake = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "tbserve.py", "serve", str(state)])
    try:
        started = tbserve.start_time(fake.pid)
        # Right after the fork the child's argv is still pytest's, until it has exec'd python: wait for it.
        deadline = time.monotonic() + 20
        while not tbserve.is_server(fake.pid, started, state):
            assert time.monotonic() < deadline, "the server's argv never showed `tbserve.py serve STATE`"
            time.sleep(0.02)
        assert not tbserve.is_server(fake.pid, started + 1, state)  # the pid, reused by a later process
        assert not tbserve.is_server(fake.pid, None, state)
        assert not tbserve.is_server(fake.pid, started, tmp_path / "OTHER")
    finally:
        fake.kill()
        fake.wait()
    assert tbserve.start_time(fake.pid) is None


def test_stop_selects_by_pid_label_or_all() -> None:
    server = {"pid": 12, "runs": ["7", "8"]}
    assert tbserve._stop_selector(["--all"])(server)  # type: ignore[misc]
    assert tbserve._stop_selector(["--pid", "12"])(server)  # type: ignore[misc]
    assert not tbserve._stop_selector(["--pid", "13"])(server)  # type: ignore[misc]
    assert tbserve._stop_selector(["9", "8"])(server)  # type: ignore[misc]
    assert not tbserve._stop_selector(["9"])(server)  # type: ignore[misc]
    assert tbserve._stop_selector([]) is None and tbserve._stop_selector(["--pid", "x"]) is None
