"""The docs site (docs/, mkdocs.yml) holds to the code: its generated reference is current, its map of the
code names every module on disk and nothing that is not there, the files it quotes are quoted as they
are, and README stays the short landing page whose test command CI runs. The site itself is built with
`mkdocs build --strict` by scripts/test.sh (broken links and anchors fail there)."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.helpers.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
CODE_ROOTS = ("submit", "launcher")


def generator() -> ModuleType:
    return load_script("scripts/docs_reference.py")


@pytest.mark.parametrize("page", ["job-spec.md", "cluster-profile.md", "cli.md"])
def test_the_generated_reference_is_what_the_code_says(page: str) -> None:
    gen = generator()
    rel = gen.REFERENCE / page
    committed = (ROOT / rel).read_text()
    if page == "cli.md":
        recorded = gen.recorded_python(committed)
        if recorded != gen.python_version():
            pytest.skip(f"{rel} was generated with Python {recorded}: argparse lays --help out differently here")
    fix = f"{rel} is stale: run `{gen.COMMAND}` and commit the result"
    assert gen.pages()[rel] == committed, fix


def test_the_job_spec_reference_names_every_key_with_its_default() -> None:
    from meshrun.launcher.contract.spec.job import Resources

    page = (ROOT / "docs" / "reference" / "job-spec.md").read_text()
    assert '| `resources.time` | string | `"01:00:00"` |' in page
    assert f"| `resources.nodes` | integer | `{Resources().nodes}` |" in page
    for key in ("train.model.n_kv_heads", "data.blend[]", "alerts.hangs", "watchdog.step_factor"):
        assert f"`{key}`" in page, key


def _map_block() -> list[str]:
    """The architecture page's first fenced block: the map of the code."""
    text = ARCHITECTURE.read_text()
    match = re.search(r"^```text\n(.*?)^```", text, re.S | re.M)
    assert match, f"{ARCHITECTURE}: no ```text block with the map of the code"
    return match.group(1).splitlines()


_ENTRY = re.compile(r"^( *)([A-Za-z_][\w]*/)")  # a folder's entry: its name first on the line
_PY = re.compile(r"(?<![\w./~-])((?:[A-Za-z_]\w*/)*[A-Za-z_]\w*\.py)\b")


def named_in_map() -> tuple[set[str], set[str]]:
    """The folders and the .py files the map names, as paths from the repo root.

    A folder's entry opens it; a line indented deeper than an entry belongs to it (the description's
    continuation lines and its children's entries alike), so `jobs.py` under `cli/` is submit/cli/jobs.py.
    A name with a slash (`contract/records/ckptdir.py`) is looked up from the entry outwards.
    """
    folders: set[str] = set()
    files: set[str] = set()
    stack: list[tuple[int, str]] = []  # (indent, folder path)
    for line in _map_block():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        entry = _ENTRY.match(line)
        if entry:
            parent = stack[-1][1] + "/" if stack else ""
            path = parent + entry.group(2).rstrip("/")
            folders.add(path)
            stack.append((indent, path))
        context = [folder for _, folder in stack]
        for name in _PY.findall(line):
            files.add(_resolve(name, context))
    return folders, files


def _resolve(name: str, context: list[str]) -> str:
    """NAME in the innermost folder of `context` where it exists (the innermost one if none has it)."""
    candidates = [f"{folder}/{name}" for folder in reversed(context)] + [name]
    for candidate in candidates:
        if (ROOT / candidate).exists():
            return candidate
    return candidates[0]


def on_disk() -> tuple[set[str], set[str]]:
    """Every package folder and every module file under submit/ and launcher/ (caches aside)."""
    folders: set[str] = set()
    files: set[str] = set()
    for root in CODE_ROOTS:
        for path in (ROOT / root).rglob("*.py"):
            rel = path.relative_to(ROOT)
            if "__pycache__" in rel.parts:
                continue
            folders.add(str(rel.parent))
            if path.name != "__init__.py":  # a package is named by its folder
                files.add(str(rel))
    return folders, files


def test_the_architecture_page_names_every_module_on_disk() -> None:
    named_folders, named_files = named_in_map()
    folders, files = on_disk()
    missing = sorted((folders - named_folders) | (files - named_files))
    assert not missing, f"docs/architecture.md's map does not name: {', '.join(missing)}; add each to its room"


def test_every_module_the_architecture_page_names_exists() -> None:
    named_folders, named_files = named_in_map()
    ours = {path for path in named_folders | named_files if path.split("/")[0] in CODE_ROOTS}
    gone = sorted(path for path in ours if not (ROOT / path).exists())
    assert not gone, f"docs/architecture.md's map names what is not on disk: {', '.join(gone)}"


def test_the_map_reader_sees_nesting_and_continuation_lines() -> None:
    folders, files = named_in_map()
    assert {"submit/cli", "submit/schedulers", "launcher/train/engines"} <= folders
    assert {"submit/cli/jobs.py", "submit/schedulers/slurm_cli.py", "launcher/train/engines/native.py"} <= files
    assert "launcher/contract/records/ckptdir.py" in files  # named as contract/records/ckptdir.py under checkpoint/


def _fence_after(page: Path, marker: str) -> str:
    text = page.read_text()
    start = text.index(marker)
    match = re.search(r"^```yaml\n(.*?)^```", text[start:], re.S | re.M)
    assert match, f"{page}: no ```yaml block after {marker!r}"
    return match.group(1)


def test_the_files_the_docs_quote_are_quoted_as_they_are() -> None:
    profiles = ROOT / "docs" / "concepts" / "cluster-profiles.md"
    assert _fence_after(profiles, "The embedded default") == (ROOT / "cluster_configs" / "local.yaml").read_text()
    specs = ROOT / "docs" / "concepts" / "job-specs.md"
    tiny = (ROOT / "examples" / "tiny.yaml").read_text()
    body = "".join(line for line in tiny.splitlines(keepends=True) if not line.startswith("#"))
    assert _fence_after(specs, "The smallest of them") == body, "copy examples/tiny.yaml (less its comment lines)"


def test_readme_is_the_short_landing_page_whose_test_command_ci_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250, "README is the landing page: move detail into docs/"
    assert "```bash\nbash scripts/run-example.sh\n```" in readme
    assert "```bash\nbash scripts/test.sh\n```" in readme
    assert "exec bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()
    for link in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert (ROOT / link).is_file(), f"README links to {link}, which does not exist"


def test_every_page_is_in_the_nav() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = sorted(str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md"))
    assert pages, "docs/ has no pages"
    missing = [page for page in pages if f": {page}\n" not in nav]
    assert not missing, f"mkdocs.yml's nav leaves out {', '.join(missing)}"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
