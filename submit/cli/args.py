"""Arguments several verbs share, defined once (submit/cli/main.py and the verb modules beside it)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

DEFAULT_CLUSTER = "local"


def cluster_arg(parser: argparse.ArgumentParser, choose: bool = False) -> None:
    """-c/--cluster: a profile name or YAML file; $MESHRUN_CLUSTER, else the embedded `local`. `choose` (submit):
    also `any` or a comma-separated list, of which the cluster that starts the job soonest is taken."""
    more = "; `any` (every profile you wrote) or a,b,c: the one that starts it soonest" if choose else ""
    parser.add_argument(
        "-c",
        "--cluster",
        default=os.environ.get("MESHRUN_CLUSTER", DEFAULT_CLUSTER),
        help=f"cluster profile name or YAML file (default: $MESHRUN_CLUSTER or local){more}",
    )


def overrides_arg(parser: argparse.ArgumentParser, help: str) -> None:
    """--set KEY=VALUE (repeatable), collected in `overrides`."""
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=help)


def positive_int(text: str) -> int:
    """An argparse type: a whole number above 0 (a count or a step), or argparse's one-line usage error."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: give a number above 0")
    return value


def spec_path(text: str) -> Path:
    """An argparse type: a job spec's path; an empty one is refused here (Path("") would read as '.')."""
    if not text.strip():
        raise argparse.ArgumentTypeError("empty: give a job spec file, e.g. examples/tiny.yaml")
    return Path(text)
