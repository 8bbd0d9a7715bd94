"""What the CLI prints about a job's code: where its sealed copy stands on the cluster, and what to run to put
it there. The lines live here, beside the other views, so that `submit/cli/` only parses and prints."""

from __future__ import annotations

import shlex
from typing import TYPE_CHECKING, Optional, Sequence

if TYPE_CHECKING:
    from meshrun.submit.transport.snapshot import Found, Snapshot


def summary(code: Optional[Snapshot]) -> Optional[dict[str, object]]:
    """The code a dry run would ship, as `submit --dry-run --json` prints it (None where none ships)."""
    if code is None:
        return None
    return {"root": str(code.root), "files": len(code.files), "bytes": code.size, "digest": code.digest}


def needed(code_dir: str, present: bool, render_argv: Sequence[str]) -> str:
    """What a hand-submitted script needs on the cluster first (`render`): its code, uploaded by --upload."""
    if present:
        return f"code: the script runs from the code snapshot {code_dir}, which is on the cluster (sealed)"
    again = shlex.join([*render_argv, "--upload"])
    return (
        f"code: the script runs from the code snapshot {code_dir}, which is not on the cluster: `{again}` "
        f"(or a `meshrun submit`) uploads it; the script refuses to start without it"
    )


def uploaded(code_dir: Optional[str]) -> str:
    return f"code: uploaded the code snapshot {code_dir}"


def unchanged(code: Snapshot, cluster: str) -> str:
    return f"code: unchanged, snapshot {code.digest} already on {cluster}"


def checked(code: Snapshot, found: Optional[Found]) -> str:
    """`submit --check`'s line for the code: its digest and whether the submit would upload it."""
    there = "already on the cluster" if found is not None and found.present else "the submit would upload it"
    return f"ok    code        snapshot {code.digest} ({len(code.files)} files): {there}"
