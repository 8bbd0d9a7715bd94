"""A `console` block -> its commands and the output shown under each; shown output matched against printed.

Rules (tests/docs/README.md): a line starting `$ ` is a command, a trailing `\\` continues it on the next
line; the lines after it up to the next `$ ` are what it shows. Shown output is an excerpt of what the
command printed (stdout and stderr together): its lines appear there consecutively, in order, except
where a line that is only `...` stands for one or more printed lines; `...` inside a line stands for any
text on that line. Trailing spaces and blank lines at the excerpt's ends do not count.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping, Sequence

ELLIPSIS = "..."


@dataclass(frozen=True)
class Command:
    line: int
    """1-based line of the `$ ` within the block's body."""
    text: str
    """The command as bash reads it (continuation lines joined with their backslash-newline)."""
    shown: tuple[str, ...]
    """The output lines shown under it (may be empty: nothing is checked)."""


class ConsoleError(ValueError):
    """A console block that is not a session: text before the first `$ `, an empty command."""


def parse_console(body: str) -> list[Command]:
    lines = body.splitlines()
    commands: list[Command] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.startswith("$ "):
            if line.strip():
                raise ConsoleError(f"line {i + 1}: a console block starts with a `$ ` command, not {line!r}")
            i += 1
            continue
        start = i
        parts = [line[2:]]
        while parts[-1].endswith("\\") and i + 1 < len(lines):
            i += 1
            parts.append(lines[i])
        text = "\n".join(parts).strip()
        if not text:
            raise ConsoleError(f"line {start + 1}: an empty command")
        i += 1
        shown = []
        while i < len(lines) and not lines[i].startswith("$ "):
            shown.append(lines[i])
            i += 1
        commands.append(Command(start + 1, text, _trim(shown)))
    return commands


def _trim(lines: list[str]) -> tuple[str, ...]:
    out = [line.rstrip() for line in lines]
    while out and not out[0]:
        out.pop(0)
    while out and not out[-1]:
        out.pop()
    return tuple(out)


NORMALIZE = (
    (re.compile(r"\blocal-[0-9a-f]{8}\b"), "local-<id>"),  # a local job's id
    (re.compile(r"-\d{8}-\d{6}-[0-9a-f]{8}\b"), "-<stamp>"),  # a run dir's date, time and random part
    (re.compile(r"\b\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}:\d{2}\b"), "<datetime>"),
    (re.compile(r"\b\d+:\d{2}:\d{2}\b"), "<h:mm:ss>"),  # elapsed, left, a time limit
)
"""Values that change run to run, made equal on both sides before comparing (tests/docs/README.md)."""
PLACEHOLDER = re.compile(r"\b(JOB|RUN_DIR)\b")


def _normal(text: str) -> str:
    for regex, stand_in in NORMALIZE:
        text = regex.sub(stand_in, text)
    return text


def _piece(text: str, values: Mapping[str, str]) -> str:
    """A literal stretch of a shown line as a regex: JOB and RUN_DIR match themselves or their value."""
    out = []
    for n, part in enumerate(PLACEHOLDER.split(_normal(text))):
        if n % 2 == 0:
            out.append(re.escape(part))
        else:
            alternatives = [re.escape(part)] + ([re.escape(_normal(values[part]))] if values.get(part) else [])
            out.append("(?:" + "|".join(alternatives) + ")")
    return "".join(out)


def pattern(shown: Sequence[str], values: Mapping[str, str] = {}) -> re.Pattern[str]:  # noqa: B006 - read only
    """The regex that finds the shown excerpt in the (normalized) printed text."""
    parts = []
    for line in (text.rstrip() for text in shown):
        if line.strip() == ELLIPSIS:
            parts.append(r"(?:[^\n]*\n)+?")
        else:
            parts.append(r"[^\n]*".join(_piece(p, values) for p in line.split(ELLIPSIS)) + r"\n")
    return re.compile(r"(?m)^" + "".join(parts))


def normalize(printed: str, home: str = "") -> str:
    """Printed text as shown text is compared with: the last state of each carriage-return redraw, no
    trailing spaces, the user's home written `~`, changing values made equal (NORMALIZE)."""
    lines = [line.rsplit("\r", 1)[-1].rstrip() for line in printed.splitlines()]
    text = "".join(f"{line}\n" for line in lines)
    if home:
        text = re.sub(re.escape(home.rstrip("/")) + r"(?=/|\b)", "~", text)
    return _normal(text)


def matches(shown: Sequence[str], printed: str, values: Mapping[str, str] = {}, home: str = "") -> bool:  # noqa: B006
    """Whether the shown excerpt is in what the command printed (`values`: JOB's and RUN_DIR's)."""
    if not shown:
        return True
    return pattern(shown, values).search(normalize(printed, home)) is not None
