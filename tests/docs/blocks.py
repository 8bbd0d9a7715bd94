"""A markdown page -> its fenced blocks, each with the `<!-- example: ... -->` markers written just above it.

Only the fence's first word (its language) decides what a block is: `console`, `bash`, `python` and
`yaml` are examples (tests/docs/README.md); anything else is prose. Markers are checked here, before
anything runs, so that a wrong marker fails the page even when the block would be skipped.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[2]
EXAMPLE_LANGS = ("console", "bash", "python", "yaml")
DIRECTIVES = ("skip", "file", "testbed", "ssh", "covered-by", "exit", "timeout", "job-spec", "profile")

_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_MARKER = re.compile(r"^\s*<!--\s*example:\s*(?P<body>.*?)\s*-->\s*$")
_MARKER_START = re.compile(r"<!--\s*example\b")


class MarkerError(ValueError):
    """A marker the runner refuses (a skip without a reason, a covered-by naming no test...): page:line says where."""


@dataclass(frozen=True)
class Marker:
    directive: str
    """One of DIRECTIVES."""
    arg: str
    """What follows it: a reason, a path, a test id, a number (empty where none is taken)."""
    line: int
    """1-based line of the comment in its page."""


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    """1-based line of the opening fence."""
    lang: str
    """The info string's first word, lower-cased ('' for a bare fence)."""
    body: str
    """The lines between the fences, the fence's indentation removed; ends with a newline unless empty."""
    markers: tuple[Marker, ...] = ()

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def is_example(self) -> bool:
        return self.lang in EXAMPLE_LANGS

    def marker(self, directive: str) -> Optional[Marker]:
        return next((m for m in self.markers if m.directive == directive), None)

    def has(self, directive: str) -> bool:
        return self.marker(directive) is not None

    @property
    def place(self) -> str:
        """Where it runs: 'ssh', 'testbed' or 'local'."""
        return "ssh" if self.has("ssh") else "testbed" if self.has("testbed") else "local"

    @property
    def runs(self) -> bool:
        """Executed (or validated) by the runner: an example that is neither skipped nor covered by a test."""
        return self.is_example and not self.has("skip") and not self.has("covered-by")


def parse_marker(text: str, line: int, where: str) -> Marker:
    """`<!-- example: DIRECTIVE [ARG] -->`'s inside -> a Marker, refused unless complete."""
    directive, _, arg = text.partition(" ")
    arg = arg.strip()
    if directive not in DIRECTIVES:
        raise MarkerError(f"{where}: unknown example marker {directive!r}; valid: {', '.join(DIRECTIVES)}")
    if directive in ("skip", "file", "covered-by", "exit", "timeout") and not arg:
        what = "a reason" if directive == "skip" else "an argument"
        raise MarkerError(f"{where}: `example: {directive}` needs {what}")
    if directive in ("testbed", "ssh", "job-spec", "profile") and arg:
        raise MarkerError(f"{where}: `example: {directive}` takes no argument (got {arg!r})")
    if directive in ("exit", "timeout") and not arg.isdigit():
        raise MarkerError(f"{where}: `example: {directive}` takes a whole number (got {arg!r})")
    if directive == "file" and (arg.startswith("/") or ".." in Path(arg).parts):
        raise MarkerError(f"{where}: `example: file {arg}`: give a path inside the sandbox (relative, or ~/...)")
    if directive == "covered-by":
        check_test_exists(arg, where)
    return Marker(directive, arg, line)


def check_test_exists(test_id: str, where: str) -> None:
    """`tests/x.py::test_name` (or `::Class::test_name`) names a test function that is there."""
    path, sep, name = test_id.partition("::")
    file = REPO / path
    if not sep or not name or not path.startswith("tests/") or not file.is_file():
        raise MarkerError(f"{where}: covered-by {test_id!r}: no such test file (give tests/PATH.py::test_name)")
    scope: list[ast.stmt] = ast.parse(file.read_text()).body
    for part in name.split("::"):
        found = next(
            (
                n
                for n in scope
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == part
            ),
            None,
        )
        if found is None:
            raise MarkerError(f"{where}: covered-by {test_id!r}: {path} has no {part!r}")
        scope = found.body
    if not name.split("::")[-1].startswith("test"):
        raise MarkerError(f"{where}: covered-by {test_id!r}: {name!r} is not a test (pytest runs test_* only)")


def _check(block: Block) -> None:
    """Markers that contradict each other or the block's kind."""
    names = [m.directive for m in block.markers]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise MarkerError(f"{block.where}: marker {sorted(dup)[0]!r} given twice")
    if block.markers and not block.is_example:
        raise MarkerError(
            f"{block.where}: example markers above a {block.lang or 'bare'} fence, which is not an example "
            f"(examples are {', '.join(EXAMPLE_LANGS)})"
        )
    if block.has("skip") and block.has("covered-by"):
        raise MarkerError(f"{block.where}: skip and covered-by together: say one")
    if block.has("file") and block.lang not in ("yaml", "bash"):
        raise MarkerError(f"{block.where}: `example: file` writes yaml or bash blocks, not {block.lang}")
    if (block.has("job-spec") or block.has("profile")) and block.lang != "yaml":
        raise MarkerError(f"{block.where}: job-spec / profile mark yaml blocks")
    if block.has("testbed") and block.has("ssh"):
        raise MarkerError(f"{block.where}: testbed and ssh together: ssh already runs on the testbed")


def parse_page(page: Path, text: Optional[str] = None) -> list[Block]:
    """Every fenced block of the page in order, with its markers checked (MarkerError otherwise).

    A marker belongs to the fence right below it (several markers: consecutive lines); a marker with
    anything else below it, a blank line included, is refused: moved prose must not orphan it."""
    lines = (page.read_text() if text is None else text).splitlines()
    blocks: list[Block] = []
    pending: list[Marker] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        marker = _MARKER.match(line)
        if marker:
            pending.append(parse_marker(marker["body"], i + 1, f"{page}:{i + 1}"))
            i += 1
            continue
        if _MARKER_START.search(line):
            raise MarkerError(f"{page}:{i + 1}: an example marker is one line: `<!-- example: DIRECTIVE [ARG] -->`")
        fence = _FENCE.match(line)
        if pending and not fence:
            raise MarkerError(f"{page}:{pending[0].line}: example marker not directly above a fence")
        if not fence:
            i += 1
            continue
        end, body = _body(lines, i, fence["indent"], fence["fence"])
        info = fence["info"].strip().split()
        block = Block(page, i + 1, info[0].lower() if info else "", body, tuple(pending))
        _check(block)
        blocks.append(block)
        pending = []
        i = end + 1
    if pending:
        raise MarkerError(f"{page}:{pending[0].line}: example marker at the end of the page, above no fence")
    return blocks


def _body(lines: list[str], start: int, indent: str, fence: str) -> tuple[int, str]:
    """(index of the closing fence, the body) of the fence opened at `start` (CommonMark: a closing fence
    is the same character, at least as long, with nothing after it; an unclosed fence runs to the end)."""
    closing = re.compile(rf"^ *{re.escape(fence[0])}{{{len(fence)},}}\s*$")
    body = []
    j = start + 1
    while j < len(lines) and not closing.match(lines[j]):
        body.append(lines[j][len(indent) :] if lines[j].startswith(indent) else lines[j].lstrip())
        j += 1
    return j, "".join(f"{line}\n" for line in body)


def pages() -> list[Path]:
    """The pages whose examples the suite runs: README.md and every page under docs/."""
    found = [REPO / "README.md"] if (REPO / "README.md").is_file() else []
    return found + sorted((REPO / "docs").rglob("*.md"))
