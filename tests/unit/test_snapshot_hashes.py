"""The snapshot's digest with its file hashes kept by stat between calls (`snapshot.FileHashes`): the same
digest as hashing every file, an edit always seen, the record private and only in a folder that is ours.
And the project's work tree found without git, as `git rev-parse --show-toplevel` finds it."""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import pytest

from meshrun.launcher.contract.spec.job import Code
from meshrun.submit.transport import snapshot
from meshrun.submit.transport.snapshot import FileHashes, collect, work_tree


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    root = tmp_path / "proj"
    (root / "pkg").mkdir(parents=True)
    (root / "train.py").write_text("print('a')\n")
    (root / "pkg" / "mod.py").write_text("X = 1\n")
    return root


def _settled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every file older than the racy window, as a checkout edited a while ago is."""
    monkeypatch.setattr(FileHashes, "RACY_NS", -(10**12))


def _uncached_digest(root: Path) -> str:
    digest = hashlib.sha256()
    for rel in ("pkg/mod.py", "train.py"):
        sha = hashlib.sha256((root / rel).read_bytes()).hexdigest()
        digest.update(f"{rel}\0{0o600:o}\0{sha}\n".encode())
    return digest.hexdigest()[:24]


def test_a_kept_hash_gives_the_digest_hashing_every_file_gives(project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _settled(monkeypatch)
    code = Code(root=str(project))
    first, expected = collect(project, code), _uncached_digest(project)
    records = list((project.parent / "cache" / "meshrun" / "file-hashes").iterdir())
    assert len(records) == 1 and records[0].stat().st_mode & 0o777 == 0o600
    reads = []
    monkeypatch.setattr(Path, "read_bytes", lambda self: reads.append(self) or b"")  # type: ignore[func-returns-value]
    second = collect(project, code)
    assert first and second and first.digest == second.digest == expected
    assert first.manifest == second.manifest and second.size == first.size == 17
    assert reads == []  # nothing read again


def test_an_edit_is_seen_even_when_the_size_and_mtime_stay(project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _settled(monkeypatch)
    code = Code(root=str(project))
    before = collect(project, code)
    target = project / "train.py"
    st = target.stat()
    target.write_text("print('b')\n")  # same size
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))  # same mtime: the ctime still moves
    after = collect(project, code)
    assert before and after and before.digest != after.digest == _uncached_digest(project)


def test_files_changed_within_the_racy_window_are_not_kept(project: Path) -> None:
    collect(project, Code(root=str(project)))  # the files were written just now: nothing is settled
    assert not list((project.parent / "cache" / "meshrun" / "file-hashes").iterdir())


def test_a_cache_folder_someone_else_owns_is_not_used(project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _settled(monkeypatch)
    folder = project.parent / "cache" / "meshrun" / "file-hashes"
    folder.mkdir(parents=True)
    real = folder.stat().st_uid
    monkeypatch.setattr(os, "getuid", lambda: real + 1)
    snap = collect(project, Code(root=str(project)))
    assert snap and snap.digest == _uncached_digest(project) and not list(folder.iterdir())


def test_a_broken_record_is_hashed_over(project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _settled(monkeypatch)
    code = Code(root=str(project))
    collect(project, code)
    (record,) = (project.parent / "cache" / "meshrun" / "file-hashes").iterdir()
    record.write_text('{"train.py": [1, 2')
    snap = collect(project, code)
    assert snap and snap.digest == _uncached_digest(project)


def test_the_work_tree_is_the_one_git_names(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "a" / "b").mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    top = subprocess.run(
        ["git", "-C", str(repo / "a" / "b"), "rev-parse", "--show-toplevel"], capture_output=True, text=True
    )
    assert work_tree(repo / "a" / "b") == Path(top.stdout.strip()) == repo
    assert work_tree(tmp_path) is None or work_tree(tmp_path) != repo
    linked = tmp_path / "linked"
    (linked / "sub").mkdir(parents=True)
    (linked / ".git").write_text("gitdir: /elsewhere\n")  # a linked worktree's or a submodule's .git file
    assert work_tree(linked / "sub") == linked
    assert snapshot.project_root(repo / "a", Code()) == repo


def test_weights_and_token_files_stay_behind_unless_code_include_names_them(project: Path) -> None:
    """`meshrun export -o model.safetensors` in a checkout: the weights do not ride along with every later
    submit (the digest is the code's alone), and the warning names them and the way to ship one."""
    before = collect(project, Code(root=str(project)))
    (project / "model.safetensors").write_bytes(b"w" * 1000)
    (project / "data").mkdir()
    (project / "data" / "corpus.u16").write_bytes(b"t" * 1000)
    found = collect(project, Code(root=str(project)))
    assert before is not None and found is not None
    assert [rel for rel, _ in found.files] == ["pkg/mod.py", "train.py"] and found.digest == before.digest
    assert found.left_out == ("data/corpus.u16", "model.safetensors")
    (line,) = snapshot.left_out_warning(found)
    assert line.startswith("not shipped with the code: data/corpus.u16, model.safetensors (") and "code.include" in line
    shipped = collect(project, Code(root=str(project), include=("*.py", "model.safetensors")))
    assert shipped is not None and sorted(dict(shipped.files)) == ["model.safetensors", "pkg/mod.py", "train.py"]
    assert shipped.left_out == ()
