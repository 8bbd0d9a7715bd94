"""Write the docs' generated reference pages from the code, so that they cannot drift from it.

    docs/reference/job-spec.md         every job-spec key: launcher/contract/spec/job.py's dataclasses
    docs/reference/cluster-profile.md  every cluster-profile key: submit/config/cluster.py's dataclasses
    docs/reference/cli.md              every verb's --help: submit/cli/main.py's build_parser()

Names, types and defaults come from the dataclasses, each key's text from the docstring under its field
in the source (read with ast: nothing is imported but the torch-free contract and the profile loader).
tests/unit/test_docs_site.py renders the pages in memory and compares them with the committed files.

    python scripts/docs_reference.py           # rewrite the pages
    python scripts/docs_reference.py --check   # exit 1 if a committed page differs
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import os
import re
import sys
import textwrap
from pathlib import Path
from typing import Any, Iterator, Optional

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = Path("docs") / "reference"
COMMAND = "python scripts/docs_reference.py"
HELP_WIDTH = 100  # argparse wraps --help at $COLUMNS - 2: fixed here, so the page is the same on every terminal

if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))


def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring: the string literal right under its annotated assignment in the class body."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for stmt, after in zip(body, body[1:] + [None]):
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            if (
                isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[stmt.target.id] = " ".join(after.value.value.split())
    return docs


def _dataclass_named(name: str, module: Any) -> Optional[type]:
    found = getattr(module, name, None)
    return found if isinstance(found, type) and dataclasses.is_dataclass(found) else None


def _type_text(node: ast.expr, module: Any) -> str:
    """A field's annotation as a YAML user reads it: Optional[int] -> 'integer or null', and so on."""
    if isinstance(node, ast.Name):
        names = {"int": "integer", "float": "number", "str": "string", "bool": "boolean", "Any": "mapping"}
        if node.id in names:
            return names[node.id]
        if _dataclass_named(node.id, module):
            return "section"
        alias = getattr(module, node.id, None)  # a Literal alias such as Precision or Engine
        if alias is not None and getattr(alias, "__origin__", None) is not None:
            return " \\| ".join(f"`{arg}`" for arg in alias.__args__)
        return node.id
    if isinstance(node, ast.Subscript):
        head = ast.unparse(node.value)
        inner = node.slice
        args = list(inner.elts) if isinstance(inner, ast.Tuple) else [inner]
        if head == "Optional":
            return f"{_type_text(args[0], module)} or null"
        if head == "Literal":
            return " \\| ".join(f"`{ast.literal_eval(a)}`" for a in args)
        if head == "tuple":
            item = args[0]
            if isinstance(item, ast.Name) and _dataclass_named(item.id, module):
                return "list of sections"
            return f"list of {_type_text(item, module)}s"
        if head in ("Mapping", "dict"):
            if len(args) == 2 and ast.unparse(args[1]) == "Any":
                return "mapping"
            return f"mapping of {_type_text(args[0], module)} to {_type_text(args[1], module)}"
    return ast.unparse(node)


def _default_text(field: dataclasses.Field[Any]) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
        if dataclasses.is_dataclass(value):
            return "(section)"
    else:
        return "required"
    if value is None:
        return "unset"
    if isinstance(value, (tuple, list)):
        value = list(value)
    return f"`{json.dumps(value) if not isinstance(value, float) else repr(value)}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


@dataclasses.dataclass
class Section:
    key: str  # "resources", "train.model", "partitions[]"; "" for the top
    cls: type
    rows: list[tuple[str, str, str, str]]  # key, type, default, meaning


def sections(cls: type, key: str = "") -> Iterator[Section]:
    """cls's own keys as one section, then each nested dataclass's, depth first in field order."""
    module = sys.modules[cls.__module__]
    docs = field_docs(cls)
    annotations = {
        stmt.target.id: stmt.annotation
        for stmt in ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body  # type: ignore[attr-defined]
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
    }
    rows = []
    nested: list[tuple[str, type]] = []
    for field in dataclasses.fields(cls):
        if not field.init:
            continue
        node = annotations[field.name]
        full = f"{key}.{field.name}" if key else field.name
        type_text = _type_text(node, module)
        child = _nested_class(node, module)
        if child is not None:
            is_list = isinstance(node, ast.Subscript) and ast.unparse(node.value) == "tuple"
            child_key = f"{full}[]" if is_list else full
            nested.append((child_key, child))
            anchor = slug(child_key)
            type_text = re.sub(r"\b(sections?)\b", rf"[\1](#{anchor})", type_text, count=1)
        rows.append((full, type_text, _default_text(field), docs.get(field.name, "")))
    yield Section(key, cls, rows)
    for child_key, child in nested:
        yield from sections(child, child_key)


def slug(key: str) -> str:
    """The anchor MkDocs gives the heading `KEY` (Python-Markdown's toc slugify: `train.model` -> trainmodel)."""
    text = re.sub(r"[^\w\s-]", "", key).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _nested_class(node: ast.expr, module: Any) -> Optional[type]:
    for name in ast.walk(node):
        if isinstance(name, ast.Name):
            found = _dataclass_named(name.id, module)
            if found is not None:
                return found
    return None


def _class_doc(cls: type) -> str:
    doc = cls.__doc__ or ""
    # A dataclass without a docstring gets a generated signature as its __doc__: not prose, left out.
    return "" if doc.startswith(f"{cls.__name__}(") else " ".join(doc.split())


def schema_page(title: str, intro: str, root: type) -> str:
    out = [
        f"# {title}",
        "",
        f"<!-- Generated by `{COMMAND}` from {root.__module__.removeprefix('meshrun.').replace('.', '/')}.py: do not edit by hand. -->",
        "",
        intro.strip(),
        "",
    ]
    for section in sections(root):
        heading = f"`{section.key}`" if section.key else "Top level"
        out += [f"## {heading}", ""]
        doc = _class_doc(section.cls)
        if doc:
            out += [_cell(doc), ""]
        out += ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
        for key, type_text, default, meaning in section.rows:
            out.append(f"| `{key}` | {type_text} | {default} | {_cell(meaning) or '—'} |")
        out.append("")
    return "\n".join(out)


JOB_SPEC_INTRO = """
Every key of a job spec, from `meshrun.launcher.contract.spec.job.JobSpec` and its sections: the type, the default and
the docstring written under the field. A key is written in YAML under its section (`train: {steps: 200}`)
or given on the command line as `--set train.steps=200`. An unknown key, a wrong type or a value out of
range is refused before anything is sent ([Job specs](../concepts/job-specs.md) explains the sections).
"""

PROFILE_INTRO = """
Every key of a cluster profile, from `meshrun.submit.config.cluster.ClusterProfile` and its sections. A profile's
`name` is its file's name (`mycluster.yaml` is `mycluster`); a `name:` key that says otherwise is refused.
[Cluster profiles](../concepts/cluster-profiles.md) explains where profiles live and how they are used.
"""


def job_spec_page() -> str:
    from meshrun.launcher.contract.spec.job import JobSpec

    return schema_page("Job spec reference", JOB_SPEC_INTRO, JobSpec)


def profile_page() -> str:
    from meshrun.submit.config.cluster import ClusterProfile

    return schema_page("Cluster profile reference", PROFILE_INTRO, ClusterProfile)


def _verbs(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def python_version() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def cli_page() -> str:
    from meshrun.submit.cli.main import build_parser

    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(HELP_WIDTH)
    try:
        parser = build_parser()
        helps = [("meshrun", parser.format_help())]
        helps += [(f"meshrun {verb}", sub.format_help()) for verb, sub in _verbs(parser).items()]
    finally:
        if saved is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = saved
    out = [
        "# Command-line reference",
        "",
        f"<!-- Generated by `{COMMAND}` from submit/cli/main.py's build_parser(), with Python "
        f"{python_version()} (argparse's layout differs between Python versions): do not edit by hand. -->",
        "",
        "Every verb's `--help`, as `meshrun VERB --help` prints it. Bad input exits 2 with one line naming the key,",
        "the value and the fix; a cluster problem exits 1 ([Exit codes and errors](../concepts/exit-codes.md)).",
        "",
    ]
    for name, text in helps:
        text = re.sub(r"[ \t]+\n", "\n", text).rstrip("\n")
        out += [f"## `{name}`", "", "```text", text, "```", ""]
    return "\n".join(out)


def pages() -> dict[Path, str]:
    """Each generated page's path (relative to the repo root) and its text."""
    return {
        REFERENCE / "job-spec.md": job_spec_page(),
        REFERENCE / "cluster-profile.md": profile_page(),
        REFERENCE / "cli.md": cli_page(),
    }


CLI_VERSION = re.compile(r"with Python (\d+\.\d+) ")


def recorded_python(cli_text: str) -> Optional[str]:
    """The Python version a committed cli.md was generated with."""
    match = CLI_VERSION.search(cli_text)
    return match.group(1) if match else None


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a committed page differs; write nothing")
    args = parser.parse_args(argv)
    stale = []
    for rel, text in pages().items():
        path = ROOT / rel
        if path.exists() and path.read_text() == text:
            continue
        stale.append(str(rel))
        if not args.check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if args.check and stale:
        print(f"stale: {', '.join(stale)}; run `{COMMAND}`", file=sys.stderr)
        return 1
    for name in stale:
        print(f"wrote {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
