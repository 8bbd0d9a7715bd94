"""Strict conversion of plain data (parsed YAML/JSON) into frozen dataclasses.

Torch-free and stdlib-only: both sides use it, the launcher to read the run spec
and `submit` to load cluster profiles and job specs. Every error names the key
path, the bad value and the fix, because the user meets these messages first.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import json
import math
import re
import types
import typing
from typing import Any, Literal, Mapping, Optional, Union, get_args, get_origin, get_type_hints

_CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f]")


T = typing.TypeVar("T")


class SchemaError(ValueError):
    """Bad input: names the key, the value and the fix."""

    def __init__(self, key: str, value: Any, fix: str) -> None:
        self.key, self.value, self.fix = key, value, fix
        super().__init__(f"{key or '<top>'}: {_show(value)}: {fix}")


@dataclasses.dataclass(frozen=True)
class Bound:
    """A number's range, declared once beside its field (`bounded`) and checked by `load` with the field's key.
    None leaves a side open; a field whose value is None (optional and unset) is not checked."""

    fix: str
    """The error's fix, as the person reads it ("give 0 to 100 restarts (default 3)")."""
    at_least: Optional[float] = None
    above: Optional[float] = None
    at_most: Optional[float] = None
    below: Optional[float] = None
    or_exactly: Optional[float] = None
    """A value allowed outside the range (0 where 0 turns a rule off)."""

    def holds(self, value: float) -> bool:
        if self.or_exactly is not None and value == self.or_exactly:
            return True
        return not (
            (self.at_least is not None and value < self.at_least)
            or (self.above is not None and value <= self.above)
            or (self.at_most is not None and value > self.at_most)
            or (self.below is not None and value >= self.below)
        )


BOUND = "bound"
"""The field metadata key `bounded` writes and `load` reads."""


def bounded(default: Any, fix: str, **limits: float) -> Any:
    """A dataclass field with a default and a Bound (its limits: at_least, above, at_most, below, or_exactly)."""
    return dataclasses.field(default=default, metadata={BOUND: Bound(fix, **limits)})


def check_bound(field: dataclasses.Field[Any], value: Any, key: str) -> None:
    """The field's declared Bound on `value`, refused naming `key`, the value and the fix."""
    found = field.metadata.get(BOUND)
    if found is not None and value is not None and not found.holds(value):
        raise SchemaError(key, value, found.fix)


SHOWN_CHARS = 320
"""An error line shows a value up to this long: a path whole (a cut one hides what is wrong with it), a
pasted blob shortened."""


def _show(value: Any) -> str:
    # Escaped even where an odd __repr__ lets control characters through: an error line must
    # never carry a terminal escape sequence from a value the user (or a sweep) gave.
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in _as_yaml(value))
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


def _as_yaml(value: Any) -> str:
    """A value in the words of the YAML the user wrote (`true`, `null`), not Python's (`True`, `None`)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(map(_as_yaml, value)) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_as_yaml(k)}: {_as_yaml(v)}" for k, v in value.items()) + "}"
    return repr(value)


class _Outline:
    """A section shown by its keys alone: under an unknown key its contents are not what is wrong (a typo'd
    `trian:` printed the whole training section, 458 characters with the valid keys)."""

    def __init__(self, keys: typing.Iterable[Any]) -> None:
        self.keys = tuple(str(k) for k in keys)

    def __repr__(self) -> str:
        return "{" + ", ".join(f"{k}: ..." for k in self.keys) + "}"


def _outline(value: Any) -> Any:
    return _Outline(value) if isinstance(value, Mapping) else value


def closest(name: str, choices: typing.Iterable[str]) -> str:
    """' (did you mean X?)' for the nearest valid name, or ''. A name that differs from valid ones only in
    its numbers (a size: 'llama-80b') gets the one of nearest size ('llama-70b'), not the nearest spelling
    ('llama3-8b')."""
    options = list(choices)
    match = _nearest_size(name, options) or next(iter(difflib.get_close_matches(name, options, n=1, cutoff=0.6)), None)
    return f" (did you mean {match!r}?)" if match else ""


_NUMBER = re.compile(r"\d+(?:\.\d+)?")


def _nearest_size(name: str, options: list[str]) -> Optional[str]:
    sizes = [float(n) for n in _NUMBER.findall(name)]
    if not sizes:
        return None
    skeleton = _NUMBER.sub("#", name)
    same = [o for o in options if _NUMBER.sub("#", o) == skeleton]
    if not same:
        return None
    return min(same, key=lambda o: sum(abs(float(a) - b) for a, b in zip(_NUMBER.findall(o), sizes)))


def check_text(key: str, value: str) -> str:
    """Reject newlines and control characters: they break scripts and logs."""
    if _CONTROL_CHARS.search(value):
        raise SchemaError(key, value, "newlines and control characters are not allowed here; use one plain line")
    return value


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def homes(cls: type, name: str, path: str = "") -> list[str]:
    """Where a key called `name` lives below dataclass `cls`, as full dotted keys (`path` is cls's own), shallowest
    first: a section written one level too high (`model:` beside `train:`) is told where it belongs."""
    here, deeper = [], []
    hints = get_type_hints(cls)
    for field in dataclasses.fields(cls):
        key, tp = _join(path, field.name), _strip_optional(hints[field.name])
        if field.name == name:
            here.append(key)
        if dataclasses.is_dataclass(tp) and isinstance(tp, type):
            deeper += homes(tp, name, key)
    return here + deeper


def unknown_key(cls: type, key: str, path: str, valid: typing.Iterable[str], leaf: Optional[str] = None) -> str:
    """The reason for an unknown `key` inside `cls` (at `path`): its new name when `cls.RENAMED` (a ClassVar
    mapping old key -> new key) has it, else where a key of that name lives below it, else the nearest spelling,
    else (a key path with a level too many or a misspelt one) where its `leaf` lives; then the valid keys."""
    names = sorted(valid)
    renamed = getattr(cls, "RENAMED", {}).get(key)
    if renamed is not None:  # a key meshrun once had: the pointer to its new name, not a spelling guess
        return f"renamed: write {_join(path, renamed)} instead"
    found = homes(cls, key, path)
    if found:
        return f"unknown key; {key} is {' or '.join(found[:2])}; valid keys: {', '.join(names)}"
    spelling = closest(key, names)
    found = homes(cls, leaf, path) if leaf is not None and not spelling else []
    hint = f"; {leaf} is {' or '.join(found[:2])}" if found else ""
    return f"unknown key{spelling}{hint}; valid keys: {', '.join(names)}"


def upgrade_renamed(cls: type, data: Any) -> Any:
    """`data` with every key a section's RENAMED lists written under its new name: for meshrun's own records
    (a run dir's spec.json written before a rename, a requeued start's embedded copy), never for a person's input,
    which is refused with the new name instead (`unknown_key`)."""
    if not isinstance(data, Mapping) or not dataclasses.is_dataclass(cls):
        return data
    renamed: Mapping[str, str] = getattr(cls, "RENAMED", {})
    out = {renamed.get(k, k) if renamed.get(k) not in data else k: v for k, v in data.items()}
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = _strip_optional(hints[f.name])
        if f.name in out and dataclasses.is_dataclass(tp) and isinstance(tp, type):
            out[f.name] = upgrade_renamed(tp, out[f.name])
    return out


def load(cls: type[T], data: Any, path: str = "") -> T:
    """Build dataclass `cls` from `data`, strictly: unknown keys and wrong types are errors."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise SchemaError(path, data, f"expected a mapping of {cls.__name__} keys")
    hints = get_type_hints(cls)
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls.__name__} is not a dataclass")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in fields:
            raise SchemaError(_join(path, str(key)), _outline(data[key]), unknown_key(cls, str(key), path, fields))
    kwargs = {}
    for name, field in fields.items():
        key = _join(path, name)
        if name in data:
            kwargs[name] = convert(hints[name], data[name], key)
            check_bound(field, kwargs[name], key)
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise SchemaError(key, None, "this key is required")
    try:
        return cls(**kwargs)
    except SchemaError:
        raise
    except (TypeError, ValueError) as exc:  # a __post_init__ check that forgot to name its key
        raise SchemaError(path, data, str(exc)) from None


def _is_optional(tp: Any) -> bool:
    return get_origin(tp) in (Union, types.UnionType) and type(None) in get_args(tp)


def convert(tp: Any, value: Any, key: str) -> Any:
    """Convert one value to type `tp` or raise SchemaError naming `key`."""
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in get_args(tp):
            return None
        options = [a for a in get_args(tp) if a is not type(None)]
        if len(options) == 1:  # Optional[X]: X's own error names the inner key (train.steps, not train)
            return convert(options[0], value, key)
        errors = []
        for option in options:
            try:
                return convert(option, value, key)
            except SchemaError as exc:
                errors.append(exc.fix)
        raise SchemaError(key, value, " or ".join(errors))
    if origin is Literal:
        choices = get_args(tp)
        if value not in choices:
            raise SchemaError(
                key, value, f"must be one of {', '.join(map(str, choices))}{closest(str(value), map(str, choices))}"
            )
        return value
    if origin in (tuple, list):
        (item,) = get_args(tp)[:1]
        if not isinstance(value, (list, tuple)):
            one = value if isinstance(value, str) else _as_yaml(value)
            raise SchemaError(key, value, f"expected a list: write [{one}] for one item (`--set` reads {one} so)")
        return tuple(convert(item, v, f"{key}[{i}]") for i, v in enumerate(value))
    if origin in (dict, collections.abc.Mapping):
        ktype, vtype = get_args(tp)
        if not isinstance(value, Mapping):
            raise SchemaError(key, value, "expected a mapping")
        return {convert(ktype, k, f"{key}.{k}"): convert(vtype, v, f"{key}.{k}") for k, v in value.items()}
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return load(tp, value, key)
    return _scalar(tp, value, key)


def _scalar(tp: Any, value: Any, key: str) -> Any:
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise SchemaError(key, value, "expected true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise SchemaError(key, value, "expected a whole number")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value) if isinstance(value, float) or abs(value) < 2**1000 else math.inf
            if not math.isfinite(number):  # YAML's .nan/.inf, --set's nan/inf: no setting means either
                raise SchemaError(key, value, "expected a finite number")
            return number
        raise SchemaError(key, value, "expected a number")
    if tp is str:
        if isinstance(value, str):
            return check_text(key, value)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return check_text(key, str(value))  # YAML reads `time: 10` or `qos: 1` as numbers
        raise SchemaError(key, value, "expected a string")
    if tp is Any:
        return value
    raise TypeError(f"schema: unsupported field type {tp!r} at {key}")


# ----------------------------------------------------------------- --set overrides


def field_type(cls: type, dotted: str) -> Any:
    """The declared type at `a.b.c` inside dataclass `cls` (mapping fields accept any key)."""
    tp: Any = cls
    walked = ""
    parts = dotted.split(".")
    for depth, part in enumerate(parts):
        parent, walked = walked, _join(walked, part)
        tp = _strip_optional(tp)
        if dataclasses.is_dataclass(tp) and isinstance(tp, type):
            names = {f.name for f in dataclasses.fields(tp)}
            if part not in names:
                leaf = parts[-1] if depth < len(parts) - 1 else None  # train.optim.lr: lr is train.lr
                raise SchemaError(walked, None, unknown_key(tp, part, parent, names, leaf))
            tp = get_type_hints(tp)[part]
        elif get_origin(tp) in (dict, collections.abc.Mapping):
            tp = get_args(tp)[1]
        elif tp is not Any:  # Any (the deepspeed: section) is free-form: deepspeed.a.b sets a nested key
            raise SchemaError(walked, None, "this key holds a single value and has no sub-keys")
    return tp


def _strip_optional(tp: Any) -> Any:
    if _is_optional(tp):
        rest = [a for a in get_args(tp) if a is not type(None)]
        return rest[0] if len(rest) == 1 else tp
    return tp


def parse_text(tp: Any, text: str, key: str) -> Any:
    """Turn `--set` text into a plain value of the field's type (validated later by load)."""
    if text in ("null", "none", "~") and _is_optional(tp):
        return None
    base = _strip_optional(tp)
    origin = get_origin(base)
    if origin in (tuple, list):
        item = get_args(base)[0]
        if dataclasses.is_dataclass(item):  # a list of sections (data.blend): YAML's flow form
            return _flow_sections(text, key)
        if text.startswith("[") and text.endswith("]"):  # YAML's flow form, as in the spec: [python3, x.py]
            parts = _flow_scalars(text, key)
        else:
            parts = text.split(",") if text else []
        return [parse_text(item, part, key) for part in parts]
    if base is bool:
        lowered = text.lower()
        if lowered in ("true", "yes", "1", "on"):
            return True
        if lowered in ("false", "no", "0", "off"):
            return False
        raise SchemaError(key, text, "expected true or false")
    if base is int:
        try:
            return int(text)
        except ValueError:
            raise SchemaError(key, text, "expected a whole number") from None
    if base is float:
        try:
            return float(text)
        except ValueError:
            raise SchemaError(key, text, "expected a number") from None
    if base is Any:  # a free-form value (the deepspeed: section): JSON's true, 5e8, [1, 2]; else the text
        try:
            return json.loads(text)
        except ValueError:
            return text
    if dataclasses.is_dataclass(base) or origin in (dict, collections.abc.Mapping):
        raise SchemaError(key, text, f"this key is a section; set one of its keys, e.g. --set {key}.<key>=VALUE")
    return text


def _flow_scalars(text: str, key: str) -> list[str]:
    """`[python3, -c, "print(1, 2)"]` read as YAML reads it in a spec (quotes group and go), every item kept
    as its text for the item's own type to judge (YAML's base loader: `yes` stays "yes", `1` stays "1")."""
    import yaml  # only here, as for _flow_sections: submit's --set, never a rank

    example = f"--set '{key}=[python3, -c, \"print(1, 2)\"]'"
    try:
        value = yaml.load(text, Loader=yaml.BaseLoader)
    except yaml.YAMLError:
        raise SchemaError(key, text, f"not a YAML list; write it in flow form, e.g. {example}") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise SchemaError(key, text, f"expected a list of plain values in YAML's flow form, e.g. {example}")
    return value


def _flow_sections(text: str, key: str) -> list[Any]:
    """`[{path: a.u16, weight: 3}, {path: b.u16}]`: the sections are checked later, as the spec's are."""
    import yaml  # only here: a list of sections on the command line is rare, and the ranks never parse one

    example = f"--set '{key}=[{{path: a.u16, weight: 3}}, {{path: b.u16, weight: 1}}]'"
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        raise SchemaError(key, text, f"not a YAML list; write it in flow form, e.g. {example}") from None
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise SchemaError(key, text, f"expected a list of sections in YAML's flow form, e.g. {example}")
    return value


def apply_overrides(cls: type, data: Mapping[str, Any], overrides: typing.Sequence[str]) -> dict[str, Any]:
    """Apply `a.b=value` overrides to a raw mapping, each cast to the field's declared type."""
    result: dict[str, Any] = _deep_copy(data)
    for item in overrides:
        if "=" not in item:
            raise SchemaError(item, item, "write overrides as --set KEY=VALUE, e.g. --set train.steps=100")
        dotted, text = item.split("=", 1)
        dotted = dotted.strip()
        try:
            tp = field_type(cls, dotted)
        except SchemaError as exc:
            raise SchemaError(exc.key, text, exc.fix) from None
        value = parse_text(tp, text, dotted)
        node = result
        parts = dotted.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = {}
                node[part] = child
            node = child
        node[parts[-1]] = value
    return result


def _deep_copy(data: Any) -> Any:
    if isinstance(data, Mapping):
        return {k: _deep_copy(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [_deep_copy(v) for v in data]
    return data


def to_plain(obj: Any) -> Any:
    """Dataclass -> JSON-ready plain data (the inverse of `load`)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        return {k: to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    return obj
