"""Reading YAML files strictly: syntax errors and schema errors point at file:line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from meshrun.launcher.contract.spec import schema
from meshrun.submit.errors import InputError
from meshrun.submit.textwidth import printable

# libyaml's parser when present: several times faster than the pure-Python one.
_BaseLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _UniqueKeyLoader(_BaseLoader):  # type: ignore[misc, valid-type]
    """SafeLoader that refuses duplicate keys (YAML silently keeps the last one)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                mark = key_node.start_mark
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", mark)
            seen.add(key)
        mapping: dict[Any, Any] = super().construct_mapping(node, deep=deep)
        return mapping


def _line_map(node: yaml.Node | None, path: str = "", lines: dict[str, int] | None = None) -> dict[str, int]:
    """Key path ('train.model.d_model', 'command[0]') -> 1-based line."""
    lines = {} if lines is None else lines
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            child = f"{path}.{key_node.value}" if path else str(key_node.value)
            lines[child] = key_node.start_mark.line + 1
            _line_map(value_node, child, lines)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            child = f"{path}[{i}]"
            lines[child] = item.start_mark.line + 1
            _line_map(item, child, lines)
    return lines


class YamlDoc:
    """A parsed YAML file that remembers where each key was written."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            text = self.path.read_text()
        except OSError as exc:
            raise InputError(str(path), str(path), f"cannot read the file ({exc.strerror})") from None
        try:
            self.data: Any = yaml.load(text, Loader=_UniqueKeyLoader)
            self.lines = _line_map(yaml.compose(text, Loader=_BaseLoader))
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
            where = f"{self.path}:{mark.line + 1}" if mark else str(self.path)
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise InputError(where, "<yaml>", f"invalid YAML: {problem}; fix the syntax at that line") from None
        if self.data is None:
            self.data = {}

    def where(self, key: str) -> str:
        """'file:line' of the key (or its nearest written parent), else 'file'."""
        probe = key
        while probe:
            if probe in self.lines:
                return f"{self.path}:{self.lines[probe]}"
            probe = probe.rsplit(".", 1)[0] if "." in probe else ""
        return str(self.path)

    def error(self, exc: schema.SchemaError) -> InputError:
        # The key may come from the user's text (a --set or a YAML key): never print it raw.
        return InputError(f"{self.where(exc.key)}: {printable(exc.key)}", exc.value, exc.fix)
