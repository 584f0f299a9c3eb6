"""Reading a YAML settings file (the service's ``--config``, the trainer's), with errors that
say what is wrong with the file rather than a parser's traceback."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


class SettingsFileError(ValueError):
    """The file cannot be read, is not YAML, or does not hold a mapping; the message says which."""


def read_settings_file(path: Path) -> dict[str, Any]:
    """The mapping of settings in ``path`` ({} for an empty file)."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise SettingsFileError(f"{path} is not a text file; give a YAML file of settings") from None
    except OSError as exc:
        raise SettingsFileError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SettingsFileError(f"{path} is not YAML: {' '.join(str(exc).split())}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SettingsFileError(f"{path} must be a mapping of settings (key: value), not a {type(data).__name__}")
    return data
