"""The testbed's own start (tests/testbed/testbed.py): a daemon that exits at once is started again, a little
later; any other failure is said at once."""

from __future__ import annotations

from typing import Any

import pytest

from tests.testbed import testbed as tb


def test_a_daemon_that_exits_while_starting_is_started_again(monkeypatch: pytest.MonkeyPatch) -> None:
    answers: list[Any] = [tb.TestbedError("testbed: slurmdbd exited with status 1 while starting."), True]

    def ensure(_d: Any) -> bool:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return bool(answer)

    monkeypatch.setattr(tb, "_ensure", ensure)
    monkeypatch.setattr(tb.time, "sleep", lambda _s: None)
    assert tb._ensure_retrying(object()) is True and answers == []  # type: ignore[arg-type]


def test_other_failures_and_the_last_try_are_said_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def busy_port(_d: Any) -> bool:
        calls.append(1)
        raise tb.TestbedError("testbed: slurmdbd cannot start: port 1 is taken by another process")

    monkeypatch.setattr(tb, "_ensure", busy_port)
    with pytest.raises(tb.TestbedError, match="port 1 is taken"):
        tb._ensure_retrying(object())  # type: ignore[arg-type]
    assert calls == [1]

    def always_exits(_d: Any) -> bool:
        calls.append(2)
        raise tb.TestbedError("testbed: slurmdbd exited with status 1 while starting.")

    monkeypatch.setattr(tb, "_ensure", always_exits)
    monkeypatch.setattr(tb.time, "sleep", lambda _s: None)
    with pytest.raises(tb.TestbedError, match="while starting"):
        tb._ensure_retrying(object())  # type: ignore[arg-type]
    assert calls.count(2) == tb.START_TRIES
