"""Irminsul: position-independent, content-addressed KV caching for MLA models."""

from __future__ import annotations

from importlib import metadata

# What a source tree that was never installed reports: a valid PEP 440 version that sorts below
# every release and says plainly that the real one is unknown.
UNKNOWN_VERSION = "0+unknown"


def _installed_version() -> str:
    """The installed distribution's version (pyproject.toml's, via the package metadata)."""
    try:
        return metadata.version("irminsul")
    except metadata.PackageNotFoundError:
        return UNKNOWN_VERSION


__version__ = _installed_version()
