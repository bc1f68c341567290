"""Checkpoints for the gate's tests, and the gate run on a directory as ``irminsul gate`` runs it.

The unsafe checkpoint is the default model with every layer's attention output projection
(``o_proj``) scaled by 4: each layer's residual stream, and with it the latent rows of the
layers above, then depends strongly on the content before it, so a row computed after other
content is far from the row full recomputation computes, however exactly k_r is rotated. Full
recomputation stays the checkpoint's own (it is a checkpoint, not a swapped runner); reuse is
what is unsafe on it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from irminsul.config import GateConfig
from irminsul.model import load_model
from irminsul.model.default import default_model_dir
from irminsul.quality import GateResult, checkpoint_hash, run_gate
from irminsul.traffic.render import ChatRenderer

O_PROJ_SCALE = 4.0


def make_unsafe(directory: Path) -> None:
    """Scale every o_proj weight of the checkpoint in ``directory`` by O_PROJ_SCALE, in place."""
    path = directory / "model.safetensors"
    weights = load_file(path)
    for name, tensor in weights.items():
        if name.endswith("self_attn.o_proj.weight"):
            weights[name] = (tensor.float() * O_PROJ_SCALE).to(tensor.dtype)
    save_file(weights, path, metadata={"format": "pt"})


def copy_default(directory: Path) -> Path:
    """A copy of the embedded default model's directory."""
    shutil.copytree(default_model_dir(), directory)
    return directory


def gate_of(model_dir: Path, config: GateConfig, **kwargs: object) -> GateResult:
    """The gate on a checkpoint directory, as ``irminsul gate`` runs it."""
    model = load_model(model_dir)
    return run_gate(model, ChatRenderer.from_dir(model_dir), checkpoint_hash(model_dir), config,
                    **kwargs)
