"""Random weights of a config's shapes, made on the device: for benchmarks, where timing does not
depend on the weights (``irminsul serve --random-weights``, benchmarks/gpu)."""

from __future__ import annotations

import torch

from .config import MLAConfig
from .model import MLAModel


def random_model(config: MLAConfig, device: str | torch.device,
                 dtype: torch.dtype = torch.bfloat16, *, seed: int = 0) -> MLAModel:
    """The config's model with weights drawn from N(0, 0.02²) on ``device`` in ``dtype``
    (built there directly: DeepSeek-V2-Lite's 15.7B parameters never pass through float32 or
    the host), norms 1, routers float32 as the loader keeps them, experts fused."""
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = MLAModel(config)
    finally:
        torch.set_default_dtype(torch.float32)
    model.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=generator)
    for name, p in model.named_parameters():
        if ".mlp.gate." in name:
            p.data = p.data.float()
    model.fuse_experts()
    return model.eval()
