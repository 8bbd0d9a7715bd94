"""The documents `meshrun data` reads: files found under folders and globs, one document per file (per
line for .jsonl).

Torch-free and stdlib-only. The order is deterministic (inputs as given, then sorted paths), so the same
inputs always give the same token file. A file whose suffix is not a known text format is refused in one
line naming it and the accepted suffixes: reading a binary as text would train on noise silently.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

from launcher.schema import SchemaError

PROSE_SUFFIXES = (".txt", ".md", ".rst")
CODE_SUFFIXES = (
    ".py",
    ".pyi",
    ".c",
    ".h",
    ".cc",
    ".cpp",
    ".hpp",
    ".cu",
    ".rs",
    ".go",
    ".java",
    ".js",
    ".ts",
    ".sh",
    ".toml",
    ".yaml",
    ".yml",
)
JSONL_SUFFIX = ".jsonl"
SUFFIXES = (*PROSE_SUFFIXES, JSONL_SUFFIX, *CODE_SUFFIXES)
"""Every format `meshrun data` reads (a file named directly, or found by a glob, must have one)."""
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", ".git"})
"""Directories never read: installed third-party packages vary between machines and break determinism."""


@dataclass(frozen=True)
class Inputs:
    """What to read: paths (files, folders or globs) and, in a folder, which suffixes count."""

    paths: tuple[str, ...]
    """Files, folders or glob patterns, read in this order."""
    suffixes: tuple[str, ...] = SUFFIXES
    """In a folder, the files read (others are skipped: a folder holds READMEs, images, lock files)."""
    field: str = "text"
    """The text field of each .jsonl line."""


def accepted() -> str:
    return " ".join(SUFFIXES)


def check_format(path: Path) -> None:
    """Refuse a file meshrun cannot read as text, naming it and the accepted suffixes."""
    if path.suffix.lower() not in SUFFIXES:
        raise SchemaError(
            "--input", str(path), f"unknown format {path.suffix or '(no suffix)'!r}; accepted: {accepted()}"
        )


def iter_files(inputs: Inputs) -> Iterator[Path]:
    """The files to read, in a deterministic order: inputs as given, each folder's and glob's paths sorted."""
    for given in inputs.paths:
        path = Path(given).expanduser()
        if path.is_file():
            check_format(path)
            yield path
        elif path.is_dir():
            yield from _walk_sorted(path, inputs.suffixes)
        elif glob.has_magic(given):
            yield from _glob_sorted(str(path))
        else:
            raise SchemaError("--input", given, "no such file or folder; give a folder, a file or a glob of text files")


def _glob_sorted(pattern: str) -> Iterator[Path]:
    matches = sorted(Path(p) for p in glob.glob(pattern, recursive=True))
    files = [p for p in matches if p.is_file()]
    if not files:
        raise SchemaError("--input", pattern, "the glob matches no file; check the pattern (quote it in the shell)")
    for path in files:
        check_format(path)
        yield path


def _walk_sorted(root: Path, suffixes: Sequence[str]) -> Iterator[Path]:
    # os.walk's order depends on the filesystem; sorting both lists in place makes it stable.
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in sorted(filenames):
            if name.lower().endswith(tuple(suffixes)):
                yield Path(dirpath) / name


def iter_documents(inputs: Inputs) -> Iterator[bytes]:
    """Every document as UTF-8 bytes (a file's own bytes, or a .jsonl line's field), empty ones skipped."""
    for path in iter_files(inputs):
        if path.suffix.lower() == JSONL_SUFFIX:
            yield from _jsonl_documents(path, inputs.field)
        else:
            data = path.read_bytes()
            if data:
                yield data


def _jsonl_documents(path: Path, field: str) -> Iterator[bytes]:
    with open(path, "rb") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            text = _field(path, number, line, field)
            if text:
                yield text.encode("utf-8", "surrogatepass")


def _field(path: Path, number: int, line: bytes, field: str) -> str:
    where = f"{path}:{number}"
    try:
        row = json.loads(line)
    except ValueError:
        raise SchemaError(
            where, line[:40].decode("utf-8", "replace"), "not a JSON line; fix the line or drop it"
        ) from None
    if not isinstance(row, dict) or field not in row:
        keys = ", ".join(sorted(row)) if isinstance(row, dict) else type(row).__name__
        raise SchemaError(
            where, f"--field {field}", f"the line has no such field (it has: {keys}); name its text field"
        )
    if not isinstance(row[field], str):
        raise SchemaError(where, f"--field {field}", f"the field holds a {type(row[field]).__name__}, not text")
    return row[field]
