"""The docs runner: every example of a page run in one session, every marker checked.

The convention (fence tags, markers, shown output, JOB and RUN_DIR) is tests/docs/README.md. A page
runs as two sessions: its local blocks (`pytest tests/docs`, no cluster needed), and its `testbed` and
`ssh` blocks with its `file` blocks (the same test file's testbed test, on the real Slurm testbed).
A block that fails is reported and the page goes on, so one run lists every broken example of a page.

`python -m tests.docs.runner [PAGE...]` prints each example's fate, and the counts, without running any.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

from tests.docs.blocks import REPO, Block, MarkerError, pages, parse_page
from tests.docs.session import ExampleFailed, Session

LOCAL = frozenset({"local"})
CLUSTER = frozenset({"testbed", "ssh"})


@dataclass
class PageRun:
    page: Path
    ran: list[Block] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def report(self) -> str:
        head = f"{_rel(self.page)}: {len(self.failures)} of {len(self.ran)} examples failed ({self.seconds:.0f} s)"
        return "\n\n".join([head, *self.failures])


def selected(blocks: Iterable[Block], places: frozenset[str]) -> list[Block]:
    """The blocks a session at `places` runs: examples that run there, and (on the cluster) the page's
    `file` blocks, which later blocks may read."""
    return [b for b in blocks if b.runs and (b.place in places or (places == CLUSTER and b.has("file")))]


def run_page(page: Path, root: Path, places: frozenset[str] = LOCAL, corpus: Optional[Path] = None) -> PageRun:
    """Run the page's examples for `places` in one sandbox under `root` (whose user has the default token
    file `corpus` already, when given); every failure is in the result."""
    result = PageRun(page)
    start = time.monotonic()
    try:
        blocks = selected(parse_page(page), places)
    except MarkerError as exc:
        result.failures.append(str(exc))
        return result
    if not blocks:
        return result
    session = Session(root, corpus)
    try:
        for block in blocks:
            result.ran.append(block)
            try:
                session.run(block)
            except ExampleFailed as exc:
                result.failures.append(str(exc))
    finally:
        session.close()
        result.seconds = time.monotonic() - start
    return result


def needs_cluster(page: Path) -> bool:
    """Whether the page has an example for the testbed (a page with a marker error counts as local: its
    local test reports the error)."""
    try:
        return any(b.runs and b.place in CLUSTER for b in parse_page(page))
    except MarkerError:
        return False


def _rel(page: Path) -> str:
    try:
        return str(page.relative_to(REPO))
    except ValueError:
        return str(page)


COMMAND_STARTS = ("$ ", "meshrun ", "python ", "python3 ", ".venv/bin/", "bash ", "source ", "cp ", "pip ", "ssh ")
COMMAND_STARTS += ("sbatch ", "from ", "import ")


def hidden_example(block: Block) -> bool:
    """A prose fence (`text`, bare) whose first line reads like a command or Python: an example that the
    runner would never run (tests/docs/test_examples.py allows none)."""
    first = next((line for line in block.body.splitlines() if line.strip()), "")
    return not block.is_example and first.startswith(COMMAND_STARTS)


def fate(block: Block) -> str:
    """What becomes of an example: 'local' or 'testbed' / 'ssh' (it runs there), 'skip' or 'covered-by'."""
    for directive in ("skip", "covered-by"):
        if block.has(directive):
            return directive
    return block.place


def main(argv: list[str]) -> int:
    chosen = [Path(a).resolve() for a in argv] or pages()
    counts = {"local": 0, "testbed": 0, "ssh": 0, "skip": 0, "covered-by": 0}
    errors = 0
    for page in chosen:
        try:
            blocks = parse_page(page)
        except MarkerError as exc:
            print(f"error: {exc}")
            errors += 1
            continue
        for block in (b for b in blocks if hidden_example(b)):
            print(f"{_rel(block.page)}:{block.line}  {block.lang or '(bare)':8} not run: a command in a prose fence")
        for block in (b for b in blocks if b.is_example):
            what = fate(block)
            marker = block.marker(what)
            print(f"{_rel(block.page)}:{block.line}  {block.lang:8} {what}{f' {marker.arg}' if marker else ''}")
            counts[what] += 1
    print(f"{sum(counts.values())} examples: " + ", ".join(f"{n} {what}" for what, n in counts.items()))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
