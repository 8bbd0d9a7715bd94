"""The user's own settings: $XDG_CONFIG_HOME/meshrun/config.yaml (default ~/.config/meshrun/config.yaml).

    notify: [notify-send, meshrun]     # `meshrun watch`'s command for each new alert (an argv list)

Optional; read strictly (an unknown key or a wrong type exits 2 naming file:line, the key and the fix).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from meshrun.launcher.contract.spec import schema
from meshrun.submit.config.yamlfile import YamlDoc
from meshrun.submit.folders import config_dir


@dataclass(frozen=True)
class UserConfig:
    notify: Optional[tuple[str, ...]] = None
    """The command `meshrun watch` runs for each new alert, as an argv list (never through a shell)."""

    def __post_init__(self) -> None:
        if self.notify is not None and (not self.notify or not all(arg.strip() for arg in self.notify)):
            raise schema.SchemaError(
                "notify", list(self.notify), "give the command as a list of words, e.g. [notify-send, meshrun]"
            )


def path() -> Path:
    return config_dir() / "config.yaml"


def load(where: Optional[Path] = None) -> UserConfig:
    """The user's config ({} when there is no file)."""
    where = where or path()
    if not where.exists():
        return UserConfig()
    doc = YamlDoc(where)
    if not isinstance(doc.data, dict):
        raise doc.error(schema.SchemaError("notify", doc.data, "the file holds a mapping, e.g. `notify: [cmd, arg]`"))
    try:
        return schema.load(UserConfig, doc.data)
    except schema.SchemaError as exc:
        raise doc.error(exc) from None
