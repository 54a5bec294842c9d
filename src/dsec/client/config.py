"""Where the SDK finds the dsec server and its token.

Precedence, per field: the arguments, then the environment (``DSEC_URL`` /
``DSEC_TOKEN``), then the config file that ``dsec up`` writes (``DSEC_CONFIG``
or ``~/.config/dsec/config.json``: ``{"url": ..., "token": ...}``), then the
default ``http://127.0.0.1:8420`` with no token.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from dsec import errors

DEFAULT_URL = "http://127.0.0.1:8420"


def config_path() -> Path:
    """The config file: ``$DSEC_CONFIG``, else ``~/.config/dsec/config.json``."""
    env = os.environ.get("DSEC_CONFIG")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".config" / "dsec" / "config.json"


def _load_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise errors.InvalidRequest(f"cannot read the dsec config file {path}: {exc}") from exc
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise errors.InvalidRequest(
            f"the dsec config file {path} is not valid JSON ({exc}); fix it or run `dsec up` again"
        ) from exc
    if not isinstance(data, dict):
        raise errors.InvalidRequest(
            f'the dsec config file {path} must hold an object {{"url": ..., "token": ...}}'
        )
    return data


def _str_or_none(value: Any, field: str, path: Path) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise errors.InvalidRequest(f"{field!r} in the dsec config file {path} must be a string")
    return value


def resolve(url: str | None, token: str | None) -> tuple[str, str | None]:
    """Return ``(url, token)`` from the arguments, the environment, the config file, the defaults."""
    url = url or os.environ.get("DSEC_URL") or None
    token = token or os.environ.get("DSEC_TOKEN") or None
    if url is None or token is None:
        path = config_path()
        data = _load_file(path)
        url = url or _str_or_none(data.get("url"), "url", path)
        token = token or _str_or_none(data.get("token"), "token", path)
    return (url or DEFAULT_URL).rstrip("/"), token
