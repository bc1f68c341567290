"""Precision of the bf16 δ-rotation against the exact (float64) key, per real rotary.

For many chunks of random raw RoPE keys, a source position and a target position (δ of both signs
up to ±131k), compares with the exact float64 key Rot(k_raw, p_target):

    recompute bf16        the key computed at p_target and stored in bf16 (what a fresh prefill
                          stores: one rounding; the floor)
    bf16 base, fp32 rot   the cached key stored in bf16 at p_source, rotated by δ in fp32
                          (angles in float64) and rounded once to bf16 — Rotary.rotate on bf16 rows
    fp32 base, fp32 rot   the same with the base kept in fp32 (the registry's k_r base), rounded once
    bf16 arithmetic       the rotation done in bf16 throughout (cos/sin and products in bf16)

Prints rel-L2 = ||approx − exact|| / ||exact|| per chunk: mean, median, p99. The paper reports
4.7e-3 for its bf16 path.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from irminsul.model import parse_config
from irminsul.model.rope import Rotary

SHAPE = dict(vocab_size=10, hidden_size=64, num_hidden_layers=1, num_attention_heads=1,
             kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
             intermediate_size=64, max_position_embeddings=163840)
YARN = dict(type="yarn", original_max_position_embeddings=4096, beta_fast=32, beta_slow=1)
CONFIGS = {
    "DeepSeek-V2-Lite": dict(model_type="deepseek_v2", rope_theta=10000,
                             rope_scaling=dict(YARN, factor=40, mscale=0.707,
                                               mscale_all_dim=0.707)),
    "DeepSeek-V3": dict(model_type="deepseek_v3", rope_theta=10000,
                        rope_scaling=dict(YARN, factor=40, mscale=1.0, mscale_all_dim=1.0)),
    "Kimi-K2": dict(model_type="kimi_k2", rope_theta=50000,
                    rope_scaling=dict(YARN, factor=32, beta_fast=1.0, beta_slow=1.0, mscale=1.0,
                                      mscale_all_dim=1.0)),
    "Moonlight-16B": dict(model_type="deepseek_v3", rope_theta=50000, rope_scaling=None),
}


def exact(rotary: Rotary, k: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """float64 interleaved rotation of k [N, R] by pos [N] (times the cos/sin magnitude)."""
    ang = pos[:, None].astype(np.float64) * rotary.inv_freq[None]
    c, s = np.cos(ang) * rotary.magnitude, np.sin(ang) * rotary.magnitude
    a, b = k[:, 0::2], k[:, 1::2]
    out = np.empty_like(k)
    out[:, 0::2], out[:, 1::2] = a * c - b * s, b * c + a * s
    return out


def bf16_arithmetic(k: torch.Tensor, rotary: Rotary, delta: torch.Tensor) -> torch.Tensor:
    ang = delta.double()[:, None] * torch.from_numpy(rotary.inv_freq)[None]
    c, s = ang.cos().bfloat16(), ang.sin().bfloat16()
    a, b = k[:, 0::2], k[:, 1::2]
    return torch.stack((a * c - b * s, b * c + a * s), dim=-1).flatten(-2)


def rel_l2(approx: torch.Tensor, target: np.ndarray, rows: int) -> np.ndarray:
    diff = (approx.double().numpy() - target).reshape(-1, rows * target.shape[1])
    return np.linalg.norm(diff, axis=1) / np.linalg.norm(target.reshape(diff.shape), axis=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=2000)
    parser.add_argument("--rows", type=int, default=32, help="tokens per chunk")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    n = args.chunks * args.rows
    print(f"{args.chunks} chunks x {args.rows} tokens, |delta| up to 131072, rel-L2 vs float64")
    print(f"{'rotary':<18} {'method':<22} {'mean':>9} {'median':>9} {'p99':>9}")
    for name, fields in CONFIGS.items():
        rotary = Rotary(parse_config({**SHAPE, **fields}))
        k_raw = rng.normal(0.0, 1.0, (n, 64))
        p_src = np.repeat(rng.integers(32, 131072, args.chunks), args.rows) + np.tile(
            np.arange(args.rows), args.chunks)
        p_tgt = np.repeat(rng.integers(32, 131072, args.chunks), args.rows) + np.tile(
            np.arange(args.rows), args.chunks)
        delta = torch.from_numpy(p_tgt - p_src)
        target = exact(rotary, k_raw, p_tgt)
        base64 = exact(rotary, k_raw, p_src)
        base_bf16 = torch.from_numpy(base64).bfloat16()
        base_fp32 = torch.from_numpy(base64).float()
        methods = {
            "recompute bf16": torch.from_numpy(target).bfloat16(),
            "bf16 base, fp32 rot": rotary.rotate(base_bf16, delta),
            "fp32 base, fp32 rot": rotary.rotate(base_fp32, delta).bfloat16(),
            "bf16 arithmetic": bf16_arithmetic(base_bf16, rotary, delta),
        }
        for method, approx in methods.items():
            err = rel_l2(approx, target, args.rows)
            print(f"{name:<18} {method:<22} {err.mean():9.2e} {np.median(err):9.2e} "
                  f"{np.percentile(err, 99):9.2e}")


if __name__ == "__main__":
    main()
