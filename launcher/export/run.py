"""`python -m meshrun.launcher.export CHECKPOINT OUT [--format meshrun|hf]`: what `meshrun export` runs where the
checkpoint is. The format's writer: consolidate.py (meshrun's names, one safetensors file) or hf.py (a folder
transformers loads)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from meshrun.launcher.contract.records import ckptdir
from meshrun.launcher.contract.spec import hfnames
from meshrun.launcher.export.consolidate import (
    ATTEMPTS,
    DEFAULT_SHARD,
    FORMATS,
    OutputError,
    Vanished,
    check_output,
    load_newest,
    write_meshrun,
)
from meshrun.launcher.export.hf import write_hf


def export(
    path: Path, out: Path, fmt: str = "meshrun", max_shard_bytes: int = hfnames.parse_size(DEFAULT_SHARD)
) -> tuple[int, Path, list[str]]:
    """Write OUT (atomically); returns the number of tensors, the step folder exported and notes to print.
    A newest-by-default checkpoint that retention deletes mid-write is exported again from the newest."""
    out = check_output(Path(out), fmt)
    newest = not (Path(path) / ckptdir.MARKER).is_file()  # a root: its newest step, whichever that is now
    for attempt in range(ATTEMPTS):
        source = load_newest(Path(path))
        try:
            if fmt == "hf":
                count, notes = write_hf(source, out, max_shard_bytes)
                return count, source.path, notes
            return write_meshrun(source, out), source.path, []
        except Vanished:
            if not newest or attempt == ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m meshrun.launcher.export", description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", type=Path, help="a step folder (ROOT/step-N) or a checkpoint root (its newest)")
    parser.add_argument("out", type=Path, help="the .safetensors file (meshrun) or the folder (hf) to write")
    parser.add_argument("--format", choices=FORMATS, default="meshrun", help="meshrun's names, or Hugging Face Llama")
    parser.add_argument("--max-shard-size", default=DEFAULT_SHARD, help="hf: the largest file (e.g. 5GB, 500MB)")
    return parser.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        max_shard = hfnames.parse_size(args.max_shard_size)
    except ValueError as exc:
        print(f"meshrun export: --max-shard-size: {exc}", file=sys.stderr)
        return 2
    try:
        count, chosen, notes = export(args.checkpoint, args.out, args.format, max_shard)
    except (ckptdir.CheckpointError, OutputError) as exc:
        print(f"meshrun export: {exc}", file=sys.stderr)
        return 2
    for note in notes:
        print(note)
    print(f"wrote {args.out} ({count} tensors) from {chosen}")
    return 0
