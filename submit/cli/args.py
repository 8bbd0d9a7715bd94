"""Arguments several verbs share, defined once (submit/cli/main.py and the verb modules beside it)."""

from __future__ import annotations

import argparse
import os

DEFAULT_CLUSTER = "local"


def cluster_arg(parser: argparse.ArgumentParser) -> None:
    """-c/--cluster: a profile name or YAML file; $MESHRUN_CLUSTER, else the embedded `local`."""
    parser.add_argument(
        "-c",
        "--cluster",
        default=os.environ.get("MESHRUN_CLUSTER", DEFAULT_CLUSTER),
        help="cluster profile name or YAML file (default: $MESHRUN_CLUSTER or local)",
    )


def overrides_arg(parser: argparse.ArgumentParser, help: str) -> None:
    """--set KEY=VALUE (repeatable), collected in `overrides`."""
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=help)
