"""Random weights of a config's shapes, made on the device: for benchmarks, where timing does not
depend on the weights (``irminsul serve --random-weights``, benchmarks/gpu)."""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch
from torch import nn

from .config import MLAConfig, QuantConfig
from .fp8 import FP8_DTYPE
from .loader import keep_float8_linears
from .model import MLAModel

FP8_BLOCK = (128, 128)  # DeepSeek-V3's, where the config names none


def random_model(config: MLAConfig, device: str | torch.device,
                 dtype: torch.dtype = torch.bfloat16, *, seed: int = 0, keep_fp8: bool = False,
                 prepare: Callable[[MLAModel], object] | None = None) -> MLAModel:
    """The config's model with weights drawn from N(0, 0.02²) on ``device`` in ``dtype``
    (built there directly: DeepSeek-V2-Lite's 15.7B parameters never pass through float32 or
    the host), norms 1, routers float32 as the loader keeps them, experts fused. Each parameter
    is drawn from a seed of its own name, so a parameter of the same name and shape is the same
    wherever it is made.

    ``keep_fp8``: the weights an FP8 checkpoint stores as float8 (every linear but the LM head
    and kv_b_proj, the routed experts included) are float8_e4m3fn values ~ N(0, 1) with block
    scales 0.02 (the config's block, else 128 × 128), as ``load_model(keep_fp8=True)`` holds
    them. ``prepare``: runs on the model on the meta device, before anything is made (tensor
    parallel's ``shard_weights``: only a rank's share is ever made)."""
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = MLAModel(config)
            if keep_fp8:
                names = {f"{name}.weight" for name, m in model.named_modules()
                         if type(m) is nn.Linear and name != "lm_head"}
                keep_float8_linears(model, names,
                                    config.quantization or QuantConfig(block=FP8_BLOCK))
            model.fuse_experts()
            if prepare is not None:
                prepare(model)
    finally:
        torch.set_default_dtype(torch.float32)
    model.to_empty(device=device)
    generator = torch.Generator(device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            generator.manual_seed(seed + zlib.crc32(name.encode()))
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("scale_inv"):
                p.fill_(0.02)
            elif p.dtype == FP8_DTYPE:
                p.copy_(torch.randn(p.shape, generator=generator, device=device,
                                    dtype=dtype).to(FP8_DTYPE))
            else:
                p.normal_(0.0, 0.02, generator=generator)
    for name, p in model.named_parameters():
        if ".mlp.gate." in name:
            p.data = p.data.float()
    return model.eval()
