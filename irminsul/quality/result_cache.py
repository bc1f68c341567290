"""Where the gate keeps its measurements: one JSON file per checkpoint and measurement setup.

A file holds the key's parts (readable: which checkpoint, probes, device, dtype, ...) and the
measurement; it is written to a temporary name and renamed, so two servers starting at once
never read half a file. A file whose parts do not match the key asked for (a hash prefix
collision, a hand edit) counts as absent.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from ..config import GateConfig


def cache_dir(config: GateConfig) -> Path:
    """``config.cache_dir``, else $XDG_CACHE_HOME/irminsul/gate (~/.cache without it)."""
    if config.cache_dir is not None:
        return Path(config.cache_dir)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "irminsul" / "gate"


def _file(directory: Path, parts: dict[str, Any]) -> Path:
    key = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()
    return directory / f"{parts['checkpoint'][:16]}-{key[:16]}.json"


def load(directory: Path, parts: dict[str, Any]) -> dict[str, Any] | None:
    """The measurement stored under ``parts``, or None."""
    path = _file(directory, parts)
    try:
        stored = json.loads(path.read_text("utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(stored, dict):  # valid JSON, but not a file save() wrote
        return None
    # The parts as JSON reads them back (a tuple, such as the shard, is a list there).
    return stored.get("measurement") if stored.get("key") == _as_json(parts) else None


def _as_json(parts: dict[str, Any]) -> Any:
    return json.loads(json.dumps(parts))


def save(directory: Path, parts: dict[str, Any], measurement: dict[str, Any]) -> Path:
    """Store ``measurement`` under ``parts``; returns the file."""
    directory.mkdir(parents=True, exist_ok=True)
    path = _file(directory, parts)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".gate-", suffix=".json")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump({"key": parts, "measurement": measurement}, f, indent=1)
    os.replace(tmp, path)
    return path
