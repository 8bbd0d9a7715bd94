"""A `yaml` block loaded by meshrun's own loaders: a cluster profile's, or a job spec's."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

import yaml

from tests.docs.blocks import Block

PROFILE_KEYS = frozenset({"scheduler", "paths", "ssh", "partitions", "interconnect", "setup"})
"""Top-level keys only a cluster profile has: a yaml block with any of them is validated as one."""
FRAGMENT_NAME = "docs-example"


def is_profile(block: Block, data: object) -> bool:
    """A `profile` / `job-spec` marker decides; else a key only a profile has."""
    if block.has("profile") or block.has("job-spec"):
        return block.has("profile")
    return isinstance(data, dict) and bool(set(data) & PROFILE_KEYS)


def problem(block: Block, scratch: Path, name: Optional[str] = None) -> Optional[str]:
    """What the loader refuses in the block (None: it loads). A job spec without `name:` is a fragment,
    checked with a name added at its end (so its line numbers stay); a profile is checked under `name`
    (its file's stem: a profile's name is its file's), else its own `name:`."""
    try:
        data = yaml.safe_load(block.body)
    except yaml.YAMLError as exc:
        return f"not YAML: {exc}"
    profile = is_profile(block, data)
    keys = set(data) if isinstance(data, dict) else set()
    text = block.body if profile or "name" in keys else f"{block.body}name: {FRAGMENT_NAME}\n"
    given = data.get("name") if isinstance(data, dict) else None
    check = scratch / f"{name or given or FRAGMENT_NAME}.yaml"
    check.parent.mkdir(parents=True, exist_ok=True)
    check.write_text(text)
    from meshrun.submit.errors import InputError

    try:
        if profile:
            from meshrun.submit.config.cluster import load_profile_file
            from meshrun.submit.schedulers import check_profile

            check_profile(load_profile_file(check))
        else:
            from meshrun.submit.planning.plan import load_job

            load_job(check)
    except InputError as exc:
        # The loader names the checked copy's file:line; the reader needs the page's.
        message = re.sub(
            re.escape(str(check)) + r"(?::(\d+))?",
            lambda m: f"{block.page}:{block.line + int(m[1])}" if m[1] else str(block.page),
            str(exc),
        )
        return f"not a valid {'cluster profile' if profile else 'job spec'}: {message}"
    return None
