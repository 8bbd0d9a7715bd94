"""Every example in README.md and docs/ runs as written (tests/docs/README.md says how to mark one that cannot)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.docs.blocks import REPO, MarkerError, pages, parse_page
from tests.docs.runner import CLUSTER, LOCAL, hidden_example, needs_cluster, run_page

PAGES = pages()


def _id(page: Path) -> str:
    return str(page.relative_to(REPO))


@pytest.mark.parametrize("page", PAGES, ids=_id)
def test_page_examples(page: Path, tmp_path: Path, default_corpus: Path) -> None:
    """The page's local examples, in order, in one sandbox: each passes or carries a marker saying why not."""
    result = run_page(page, tmp_path, LOCAL, default_corpus)
    assert not result.failures, result.report()


@pytest.mark.slurm
@pytest.mark.parametrize("page", [p for p in PAGES if needs_cluster(p)], ids=_id)
def test_page_examples_on_testbed(page: Path, tmp_path: Path, default_corpus: Path, testbed: dict[str, object]) -> None:
    """The page's `testbed` and `ssh` examples on the real Slurm testbed (and over its sshd)."""
    result = run_page(page, tmp_path, CLUSTER, default_corpus)
    assert not result.failures, result.report()


@pytest.mark.parametrize("page", PAGES, ids=_id)
def test_no_example_hides_in_a_prose_fence(page: Path) -> None:
    """A command or Python in a `text` fence is never run: no page has one (make it a console, bash or python
    block, with a marker where it cannot run)."""
    try:
        hidden = [b for b in parse_page(page) if hidden_example(b)]
    except MarkerError:
        return  # test_page_examples reports it
    where = ", ".join(f"line {b.line}" for b in hidden)
    assert not hidden, (
        f"{_id(page)}: {len(hidden)} prose fence(s) hold commands or Python ({where}); "
        f"make each a console, bash or python block (tests/docs/README.md)"
    )
