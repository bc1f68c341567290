"""Measured peaks and how close the prefill and the δ-rotation come to them (a GPU suite section).

Peaks are measured on the machine, not taken from a datasheet: bf16 dense matmul TFLOP/s
(8192³ ``torch.matmul``) and device-to-device copy bandwidth (read + write bytes). A fresh prefill
is scored by the MoE's *active* FLOPs (:func:`prefill_flops`) per second against the matmul peak;
the rotation of a reused chunk by the k_r bytes it reads and writes against the copy bandwidth.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch
from common import CallTime, per_call, sync

from irminsul.model import MLAModel
from irminsul.model.config import MLAConfig
from irminsul.model.rope import Rotary

# (k_r pool [layers, slots, rope], src slots | dst slots | δ per row, rotary): kr[:, dst] = rotated
RotateFn = Callable[[torch.Tensor, torch.Tensor, Rotary], None]


def prefill_flops(cfg: MLAConfig, tokens: int, logit_tokens: int) -> int:
    """Active FLOPs (2 per multiply-add) of a fresh causal prefill of ``tokens`` tokens in the
    per-head form (W_UK/W_UV applied to every token's c_KV), with ``logit_tokens`` rows through
    lm_head. Elementwise work (norms, rotary, softmax, SiLU) is left out."""
    d, heads = cfg.hidden_size, cfg.num_attention_heads
    qk, v = cfg.qk_head_dim, cfg.v_head_dim
    query = (d * heads * qk if cfg.q_lora_rank is None
             else d * cfg.q_lora_rank + cfg.q_lora_rank * heads * qk)
    attn_proj = (query + d * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
                 + cfg.kv_lora_rank * heads * (cfg.qk_nope_head_dim + v) + heads * v * d)
    moe_mlp = (d * (cfg.n_routed_experts or 0)  # the router
               + 3 * d * cfg.moe_intermediate_size * (cfg.n_shared_experts + cfg.num_experts_per_tok))
    per_token = sum(attn_proj + (moe_mlp if cfg.is_moe_layer(i) else 3 * d * cfg.intermediate_size)
                    for i in range(cfg.num_hidden_layers))
    # Causal attention in its naive form: T²/2 query-key pairs, each QK^T and PV per head.
    attention = cfg.num_hidden_layers * tokens * tokens // 2 * heads * (qk + v)
    return 2 * (tokens * per_token + logit_tokens * d * cfg.vocab_size + attention)


def _median_seconds(device: str, fn: Callable[[], Any], repeats: int) -> float:
    """Median device seconds per call."""
    return _median_times(device, fn, repeats).device


def _median_times(device: str, fn: Callable[[], Any], repeats: int) -> CallTime:
    fn()  # warm-up: kernels chosen, memory allocated
    times = [per_call(device, fn, 5) for _ in range(repeats)]
    return CallTime(*(statistics.median(t[i] for t in times) for i in range(2)))


def matmul_peak(device: str, n: int = 8192, repeats: int = 20) -> float:
    """Measured bf16 dense matmul TFLOP/s (n³ ``torch.matmul``, median of repeats)."""
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    return 2 * n**3 / _median_seconds(device, lambda: torch.matmul(a, b), repeats) / 1e12


def copy_bandwidth(device: str, nbytes: int = 2**30, repeats: int = 20) -> float:
    """Measured device-to-device copy GB/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / _median_seconds(device, lambda: dst.copy_(src), repeats) / 1e9


def prefill_efficiency(model: MLAModel, ids: torch.Tensor, peak_tflops: float,
                       repeats: int = 5) -> dict[str, float]:
    """A fresh prefill's active TFLOP/s and its fraction of the matmul peak. The forward computes
    logits for every prompt token, so lm_head counts all of them."""
    device = str(model.lm_head.weight.device)
    tokens = int(ids.shape[0])
    seconds = _median_seconds(device, lambda: model.forward(ids, torch.arange(tokens)), repeats)
    flops = prefill_flops(model.config, tokens, tokens)
    achieved = flops / seconds / 1e12
    return {"tokens": tokens, "active_tflop": flops / 1e12, "ms": 1e3 * seconds,
            "tflops": achieved, "fraction_of_matmul_peak": achieved / peak_tflops}


def torch_rotate(kr: torch.Tensor, rot: torch.Tensor, rotary: Rotary) -> None:
    """The engine's plain-torch gather–rotate–scatter (``ModelRunner.rotate`` without the kernels)."""
    src, dst, delta = rot.view(3, -1)
    base = kr[:, src].transpose(0, 1)  # [tokens, layers, rope_dim]
    kr[:, dst] = rotary.rotate(base, delta).transpose(0, 1)


def rotate_implementations(device: str) -> dict[str, RotateFn]:
    """The rotations to measure: plain torch, and on a GPU the Triton kernel where it exists."""
    found: dict[str, RotateFn] = {"torch": torch_rotate}
    if torch.device(device).type != "cuda":
        return found
    try:
        from irminsul.kernels import rotate_kr
    except ImportError:  # no triton or no kernel yet
        return found

    def triton_rotate(kr: torch.Tensor, rot: torch.Tensor, rotary: Rotary) -> None:
        """The kernel, the rotary unpacked into its plain arguments (as the engine does)."""
        rotate_kr(kr, rot, *rotary.kernel_args(kr.device))

    found["triton"] = triton_rotate
    return found


def rotation_bandwidth(model: MLAModel, rotate: RotateFn, tokens: int, copy_gbps: float,
                       repeats: int = 20) -> dict[str, float]:
    """GB/s of rotating a reused chunk of ``tokens`` tokens' k_r in every layer (source rows read,
    destination rows written, distinct slots, δ varying per row) and its fraction of the copy
    bandwidth: ``copy_gbps`` (a large copy's) and that of a copy moving the same bytes (a
    ~100 MB copy does not reach a 1 GiB copy's rate either)."""
    cfg = model.config
    device = str(model.lm_head.weight.device)
    kr = torch.randn(cfg.num_hidden_layers, 2 * tokens, cfg.qk_rope_head_dim, device=device,
                     dtype=model.lm_head.weight.dtype)
    slots = torch.randperm(2 * tokens, device=device)  # scattered, as pool slots are
    delta = torch.randint(-tokens, tokens, (tokens,), device=device)
    rot = torch.cat([slots, delta])  # src | dst | δ
    sync(device)
    times = _median_times(device, lambda: rotate(kr, rot, model.rotary), repeats)
    seconds = times.device
    nbytes = 2 * kr[:, :tokens].numel() * kr.element_size()
    achieved = nbytes / seconds / 1e9
    same = copy_bandwidth(device, nbytes // 2, repeats)
    return {"tokens": tokens, "bytes": nbytes, "us": 1e6 * seconds,
            "issue_us": 1e6 * times.issue, "gbps": achieved,
            "fraction_of_copy_bandwidth": achieved / copy_gbps,
            "same_bytes_copy_gbps": same, "fraction_of_same_bytes_copy": achieved / same}
