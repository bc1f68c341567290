"""The embedded default model: a small DeepSeek-V2 (MLA + MoE) trained for Irminsul and shipped
in the package (irminsul/default_model/, its README.md is the model card), so the model commands
run with no download and no ``--model``."""

from __future__ import annotations

import importlib.resources
from pathlib import Path


def default_model_dir() -> Path:
    """The shipped default model's directory (config, safetensors, tokenizer, chat template)."""
    # Installed as plain files (setuptools, not zipped), so str() is a real path.
    return Path(str(importlib.resources.files("irminsul") / "default_model"))
