"""Models named by a Hugging Face Hub repo id, resolved to a local checkpoint directory.

``--model`` takes a directory or a repo id (``deepseek-ai/DeepSeek-V2-Lite-Chat``, optionally
``@revision``). A repo id is fetched with ``huggingface_hub`` into its standard cache
(``HF_HOME`` / ``HF_HUB_CACHE``), only the files a checkpoint needs, and honours its settings:
with ``HF_HUB_OFFLINE=1`` nothing is fetched and the cached snapshot is used or a clear error
says it is missing. A path that exists always wins over a repo id of the same spelling.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# What load_model and the chat renderer read; weights in safetensors only (no pickles).
CHECKPOINT_FILES = ["config.json", "generation_config.json", "*.safetensors",
                    "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
                    "chat_template.jinja", "LICENSE*", "README.md"]
# org/name with the Hub's characters, optionally @revision.
_REPO_ID = re.compile(r"^[\w.\-]+/[\w.\-]+(@[\w.\-/]+)?$")


class ModelNotFound(FileNotFoundError):
    """Neither a checkpoint directory nor a repo id that could be resolved."""


def resolve_model(name: str | os.PathLike) -> Path:
    """The checkpoint directory for ``name``: the directory itself, or the cached snapshot of a
    Hub repo id (fetched first unless ``HF_HUB_OFFLINE`` is set)."""
    path = Path(name)
    if path.exists():
        if not path.is_dir():
            raise ModelNotFound(f"{name}: not a directory (a checkpoint is a directory holding "
                                "config.json, safetensors weights and a tokenizer)")
        return path
    text = str(name)
    if not _REPO_ID.match(text):
        raise ModelNotFound(f"{name}: no such directory, nor a Hub repo id (org/name[@revision])")
    repo, _, revision = text.partition("@")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return Path(snapshot_download(repo, revision=revision or None,
                                      allow_patterns=CHECKPOINT_FILES))
    except LocalEntryNotFoundError as err:
        offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
        raise ModelNotFound(
            f"{text}: not in the Hugging Face cache"
            + (" and HF_HUB_OFFLINE is set: fetch it once online, or point --model at a "
               "directory" if offline else " and the Hub could not be reached") + f" ({err})"
        ) from err
    except (RepositoryNotFoundError, RevisionNotFoundError) as err:
        raise ModelNotFound(f"{text}: no such repo or revision on the Hub ({err})") from err
    except HFValidationError as err:
        raise ModelNotFound(f"{text}: not a valid Hub repo id ({err})") from err
