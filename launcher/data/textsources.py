"""The documents `meshrun data` reads: files found under folders and globs, one document per file (per
line for .jsonl).

Torch-free and stdlib-only. The order is deterministic (inputs as given, then sorted paths), so the same
inputs always give the same token file. A file whose suffix is not a known text format is refused in one
line naming it and the accepted suffixes: reading a binary as text would train on noise silently.

Nothing is dropped silently: a Reader tallies what it passed over (a folder's files of other formats,
the folders never read, empty documents, and what a size cap left unread) for `meshrun data`'s summary.
A cap stops before the document that would cross it: a document is read whole or not at all.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional, Sequence

from meshrun.launcher.contract.spec.schema import SchemaError

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
            "INPUT", str(path), f"unknown format {path.suffix or '(no suffix)'!r}; accepted: {accepted()}"
        )


@dataclass
class Tally:
    """What a read passed over, filled in as it goes (mutable on purpose: a running count)."""

    other_format: int = 0
    """Files in a folder whose suffix is not read (a folder's READMEs, images, lock files)."""
    other_kinds: dict[str, int] = field(default_factory=dict)
    """How many of them per suffix (or name, without one)."""
    folders: list[str] = field(default_factory=list)
    """Folders never read (SKIP_DIRS)."""
    empty: int = 0
    """Empty files and .jsonl lines whose text is empty: no document."""
    documents: int = 0
    """Documents read."""
    bytes_read: int = 0
    """Text read, in bytes."""
    unread_files: int = 0
    """Files the size cap left unread (none of their text read)."""
    unread_bytes: int = 0
    """Their size on disk."""
    stopped_in: str = ""
    """A .jsonl the cap stopped inside (its first lines read, the rest not)."""

    def counts(self) -> dict[str, int]:
        """The record's `skipped` field: every count, zeros included."""
        return {
            "other_format_files": self.other_format,
            "folders": len(self.folders),
            "empty_documents": self.empty,
            "unread_files": self.unread_files,
            "unread_bytes": self.unread_bytes,
        }

    def describe(self, max_bytes: Optional[int]) -> str:
        """One line of what was skipped, or "" when nothing was."""
        parts = []
        if self.unread_files or self.stopped_in:
            rest = f"{self.unread_files:,} file(s), {self.unread_bytes / 1e6:.1f} MB" if self.unread_files else ""
            inside = f"the rest of {self.stopped_in}" if self.stopped_in else ""
            limit = f"{(max_bytes or 0) / 1e6:.3g} MB"
            parts.append(f"not read past the {limit} cap (--max-mb): {' and '.join(p for p in (rest, inside) if p)}")
        if self.other_format:
            kinds = sorted(self.other_kinds, key=lambda k: (-self.other_kinds[k], k))  # the commonest first
            shown = ", ".join(kinds[:6]) + (", ..." if len(kinds) > 6 else "")
            parts.append(f"{self.other_format:,} file(s) of other formats in folders ({shown})")
        if self.folders:
            names = ", ".join(sorted({Path(p).name for p in self.folders}))
            parts.append(f"{len(self.folders):,} folder(s) never read ({names})")
        if self.empty:
            parts.append(f"{self.empty:,} empty document(s)")
        return f"skipped: {'; '.join(parts)}" if parts else ""


def iter_files(inputs: Inputs, tally: Optional[Tally] = None) -> Iterator[Path]:
    """The files to read, in a deterministic order: inputs as given, each folder's and glob's paths sorted."""
    tally = Tally() if tally is None else tally
    for given in inputs.paths:
        path = Path(given).expanduser()
        if path.is_file():
            check_format(path)
            yield path
        elif path.is_dir():
            yield from _walk_sorted(path, inputs.suffixes, tally)
        elif glob.has_magic(given):
            yield from _glob_sorted(str(path))
        else:
            raise SchemaError("INPUT", given, "no such file or folder; give a folder, a file or a glob of text files")


def _glob_sorted(pattern: str) -> Iterator[Path]:
    matches = sorted(Path(p) for p in glob.glob(pattern, recursive=True))
    files = [p for p in matches if p.is_file()]
    if not files:
        raise SchemaError("INPUT", pattern, "the glob matches no file; check the pattern (quote it in the shell)")
    for path in files:
        check_format(path)
        yield path


def _walk_sorted(root: Path, suffixes: Sequence[str], tally: Tally) -> Iterator[Path]:
    # os.walk's order depends on the filesystem; sorting both lists in place makes it stable.
    for dirpath, dirnames, filenames in os.walk(root):
        tally.folders.extend(os.path.join(dirpath, d) for d in dirnames if d in SKIP_DIRS)
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in sorted(filenames):
            if name.lower().endswith(tuple(suffixes)):
                yield Path(dirpath) / name
            else:
                tally.other_format += 1
                kind = Path(name).suffix.lower() or name
                tally.other_kinds[kind] = tally.other_kinds.get(kind, 0) + 1


class Reader:
    """Every document of `inputs` once, whole, up to `max_bytes` of text (None: all of it), tallying
    what it passes over in `tally`."""

    def __init__(self, inputs: Inputs, max_bytes: Optional[int] = None) -> None:
        self.inputs, self.max_bytes, self.tally = inputs, max_bytes, Tally()

    def documents(self) -> Iterator[bytes]:
        """UTF-8 bytes of each document (a file's own bytes, or a .jsonl line's field), empty ones skipped.

        The cap stops before the document that would cross it (the first document is always read): a
        document is never cut. What is left unread is counted, by file size, without reading it."""
        files = list(iter_files(self.inputs, self.tally))  # names only: cheap, and the rest can be counted
        tally, cap = self.tally, self.max_bytes
        for index, path in enumerate(files):
            for number, doc in enumerate(_documents_of(path, self.inputs.field, tally)):
                if cap is not None and tally.documents and tally.bytes_read + len(doc) > cap:
                    if number:
                        tally.stopped_in = str(path)
                    rest = files[index + 1 if number else index :]
                    tally.unread_files = len(rest)
                    tally.unread_bytes = sum(p.stat().st_size for p in rest)
                    return
                tally.documents += 1
                tally.bytes_read += len(doc)
                yield doc


def iter_documents(inputs: Inputs) -> Iterator[bytes]:
    """Every document as UTF-8 bytes (a file's own bytes, or a .jsonl line's field), empty ones skipped."""
    return Reader(inputs).documents()


def _documents_of(path: Path, field: str, tally: Tally) -> Iterator[bytes]:
    if path.suffix.lower() == JSONL_SUFFIX:
        yield from _jsonl_documents(path, field, tally)
        return
    data = path.read_bytes()
    if data:
        yield data
    else:
        tally.empty += 1


def _jsonl_documents(path: Path, field: str, tally: Tally) -> Iterator[bytes]:
    with open(path, "rb") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue  # a blank line is layout, not a document
            text = _field(path, number, line, field)
            if text:
                yield text.encode("utf-8", "surrogatepass")
            else:
                tally.empty += 1


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
