"""code.include / code.exclude / the always-excluded names: `snapshot.matches` is compiled into regexes once
per tuple of patterns (a checkout's every file is tested against the same few); it must mean exactly what
the plain fnmatch rules below say, for any path and pattern."""

from __future__ import annotations

import fnmatch

from hypothesis import given, settings
from hypothesis import strategies as st

from meshrun.submit.transport.snapshot import matches


def by_the_rules(rel: str, patterns: tuple[str, ...]) -> bool:
    """fnmatch on the whole path (`*` crosses folders), a bare name on any part, a leading folder."""
    parts = rel.split("/")
    for raw in patterns:
        pattern = raw.strip("/")
        if not pattern:
            continue
        if fnmatch.fnmatchcase(rel, pattern) or rel.startswith(pattern + "/"):
            return True
        if "/" not in pattern and any(fnmatch.fnmatchcase(part, pattern) for part in parts):
            return True
        if any(fnmatch.fnmatchcase("/".join(parts[:i]), pattern) for i in range(1, len(parts))):
            return True
    return False


PATHS = st.lists(st.text(alphabet="ab.", min_size=1, max_size=3), min_size=1, max_size=4).map("/".join)
PATTERNS = st.lists(st.text(alphabet="ab*?/.[]!", max_size=5), max_size=3).map(tuple)


@settings(max_examples=400, deadline=None)
@given(PATHS, PATTERNS)
def test_the_compiled_patterns_mean_what_fnmatch_says(rel: str, patterns: tuple[str, ...]) -> None:
    assert matches(rel, patterns) == by_the_rules(rel, patterns)


def test_the_documented_cases() -> None:
    assert matches("src/__pycache__/x.pyc", ("__pycache__",))  # a bare name at any depth, and all under it
    assert matches("data/big/shard.bin", ("data",)) and matches("data/big/shard.bin", ("data/*",))
    assert matches("a/b/c.ckpt", ("*.ckpt",)) and not matches("a/b/c.ckpt", ("b/*.pt",))
    assert not matches("datasets/x", ("data",)) and not matches("x", ())
