"""config.json of a DeepSeek-family MLA checkpoint, read in both on-disk formats.

Official checkpoints ship the legacy form (``rope_theta`` + ``rope_scaling``); transformers >= 5
rewrites configs as ``rope_parameters`` ({"rope_type", "rope_theta", ...}). Both are accepted. What
cannot be honoured (an unknown model type or rope type, a scaling dict without its keys, a
quantization other than FP8 block scaling) is refused with a message naming the field: a silent
fallback to plain RoPE collapses output quality (the paper's Appendix D).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MODEL_TYPES = {"deepseek_v2": "deepseek_v2", "deepseek_v3": "deepseek_v3", "kimi_k2": "deepseek_v3"}
YARN_KEYS = ("factor", "original_max_position_embeddings")


class ConfigError(ValueError):
    """config.json asks for something this runtime cannot honour, or is malformed."""


@dataclass(frozen=True)
class RopeConfig:
    """Rotary settings of the 64-dim RoPE slice: plain (``kind == "default"``) or YaRN."""

    theta: float
    kind: str = "default"  # "default" | "yarn"
    factor: float = 1.0
    original_max_position: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None  # the cos/sin magnitude, where given (else mscale's)


@dataclass(frozen=True)
class QuantConfig:
    """FP8 block quantization (DeepSeek-V3 / Kimi-K2): weight * weight_scale_inv per block."""

    block: tuple[int, int] = (128, 128)


@dataclass(frozen=True)
class MLAConfig:
    """The fields of a DeepSeek-V2/V3 (and Kimi-K2) config.json the runtime uses."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    rope_interleave: bool = True
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    # MoE (n_routed_experts None => every layer dense)
    n_routed_experts: int | None = None
    n_shared_experts: int = 0
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    n_group: int = 1
    topk_group: int = 1
    topk_method: str = "greedy"
    scoring_func: str = "softmax"
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    num_nextn_predict_layers: int = 0
    quantization: QuantConfig | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one cached latent row: [c_KV (kv_lora_rank) | k_r (qk_rope_head_dim)]."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return (self.n_routed_experts is not None and layer >= self.first_k_dense_replace
                and layer % self.moe_layer_freq == 0)


def _rope(raw: dict[str, Any], where: str) -> RopeConfig:
    params = raw.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise ConfigError(f"{where}: rope_parameters must be an object, got {params!r}")
        scaling, theta = params, params.get("rope_theta", raw.get("rope_theta"))
    else:
        scaling, theta = raw.get("rope_scaling"), raw.get("rope_theta")
    if theta is None:
        raise ConfigError(f"{where}: no rope_theta (neither top level nor in rope_parameters)")
    if not isinstance(theta, (int, float)) or theta <= 0:
        raise ConfigError(f"{where}: rope_theta must be a positive number, got {theta!r}")
    if scaling is None:
        return RopeConfig(theta=float(theta))
    if not isinstance(scaling, dict):
        raise ConfigError(f"{where}: rope_scaling must be an object or null, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default") and not any(k in scaling for k in YARN_KEYS):
        return RopeConfig(theta=float(theta))
    if kind != "yarn":
        raise ConfigError(f"{where}: rope type {kind!r} is not supported (supported: default, "
                          "yarn); refusing rather than falling back to plain RoPE")
    missing = [k for k in YARN_KEYS if not isinstance(scaling.get(k), (int, float))]
    if missing:
        raise ConfigError(f"{where}: yarn rope scaling lacks numeric {', '.join(missing)}")
    if scaling.get("truncate", True) is not True:
        # transformers' YaRN then leaves the correction range unrounded: other frequencies.
        raise ConfigError(f"{where}: yarn rope scaling with truncate "
                          f"{scaling['truncate']!r} is not supported (only the rounded range)")
    return RopeConfig(
        theta=float(theta), kind="yarn", factor=float(scaling["factor"]),
        original_max_position=int(scaling["original_max_position_embeddings"]),
        beta_fast=float(scaling.get("beta_fast") or 32.0),
        beta_slow=float(scaling.get("beta_slow") or 1.0),
        mscale=_optional_float(scaling.get("mscale")),
        mscale_all_dim=_optional_float(scaling.get("mscale_all_dim")),
        attention_factor=_optional_float(scaling.get("attention_factor")))


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _quant(raw: dict[str, Any], where: str) -> QuantConfig | None:
    q = raw.get("quantization_config")
    if q is None:
        return None
    method = q.get("quant_method") if isinstance(q, dict) else None
    if method != "fp8" or q.get("fmt", "e4m3") != "e4m3":
        raise ConfigError(f"{where}: quantization {q!r} is not supported "
                          "(supported: fp8 e4m3 with weight_block_size)")
    block = q.get("weight_block_size", [128, 128])
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) for b in block)):
        raise ConfigError(f"{where}: fp8 weight_block_size must be [rows, cols], got {block!r}")
    return QuantConfig(block=(block[0], block[1]))


def parse_config(raw: dict[str, Any], where: str = "config.json") -> MLAConfig:
    """Validate a config.json dict; errors name ``where`` and the offending field."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a JSON object")
    model_type = raw.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ConfigError(f"{where}: model_type {model_type!r} is not an MLA model this runtime "
                          f"knows (supported: {', '.join(MODEL_TYPES)})")

    def need(name: str, kind: type = int) -> Any:
        value = raw.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ConfigError(f"{where}: {name} must be {kind.__name__}, got {value!r}")
        return value

    def count(name: str, default: int, least: int) -> int:
        value = raw.get(name, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ConfigError(f"{where}: {name} must be an integer >= {least}, got {value!r}")
        return value

    def positive_float(name: str, default: float) -> float:
        value = raw.get(name, default)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            raise ConfigError(f"{where}: {name} must be a positive number, got {value!r}")
        return float(value)

    heads = need("num_attention_heads")
    kv_heads = raw.get("num_key_value_heads", heads)
    if kv_heads != heads:
        raise ConfigError(f"{where}: num_key_value_heads ({kv_heads}) must equal "
                          f"num_attention_heads ({heads}) in MLA")
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):  # the MLPs and experts are SwiGLU (transformers: ACT2FN)
        raise ConfigError(f"{where}: hidden_act {act!r} is not supported (supported: silu)")
    q_lora = raw.get("q_lora_rank")
    if q_lora is not None and not isinstance(q_lora, int):
        raise ConfigError(f"{where}: q_lora_rank must be an integer or null, got {q_lora!r}")
    routed = raw.get("n_routed_experts")
    moe: dict[str, Any] = {}
    if routed is not None:
        moe = dict(
            n_routed_experts=need("n_routed_experts"),
            n_shared_experts=int(raw.get("n_shared_experts") or 0),
            num_experts_per_tok=need("num_experts_per_tok"),
            moe_intermediate_size=need("moe_intermediate_size"),
            first_k_dense_replace=count("first_k_dense_replace", 0, 0),
            moe_layer_freq=count("moe_layer_freq", 1, 1),
            n_group=int(raw.get("n_group") or 1), topk_group=int(raw.get("topk_group") or 1),
            topk_method=str(raw.get("topk_method") or "greedy"),
            scoring_func=str(raw.get("scoring_func") or "softmax"),
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)))
        if MODEL_TYPES[model_type] == "deepseek_v3":
            # V3-style routing whatever the file says (as transformers and the reference do).
            moe.update(topk_method="noaux_tc", scoring_func="sigmoid")
        elif moe["topk_method"] not in ("greedy", "group_limited_greedy"):
            raise ConfigError(f"{where}: topk_method {moe['topk_method']!r} is not supported for "
                              "deepseek_v2 (greedy, group_limited_greedy)")
        elif moe["scoring_func"] != "softmax":
            raise ConfigError(f"{where}: scoring_func {moe['scoring_func']!r} is not supported "
                              "for deepseek_v2 (softmax)")
        if moe["n_routed_experts"] % moe["n_group"]:
            raise ConfigError(f"{where}: n_routed_experts ({routed}) is not divisible by n_group "
                              f"({moe['n_group']})")
        grouped = moe["n_group"] > 1 and moe["topk_method"] != "greedy"  # else groups unused
        if grouped and not 1 <= moe["topk_group"] <= moe["n_group"]:
            raise ConfigError(f"{where}: topk_group ({moe['topk_group']}) must be in 1 .. n_group "
                              f"({moe['n_group']})")
        reachable = (moe["topk_group"] * (routed // moe["n_group"]) if grouped else routed)
        if not 1 <= moe["num_experts_per_tok"] <= reachable:
            raise ConfigError(f"{where}: num_experts_per_tok ({moe['num_experts_per_tok']}) must "
                              f"be in 1 .. {reachable} (the experts a token can be routed to)")
    return MLAConfig(
        model_type=MODEL_TYPES[model_type], vocab_size=need("vocab_size"),
        hidden_size=need("hidden_size"), num_hidden_layers=need("num_hidden_layers"),
        num_attention_heads=heads, q_lora_rank=q_lora, kv_lora_rank=need("kv_lora_rank"),
        qk_nope_head_dim=need("qk_nope_head_dim"), qk_rope_head_dim=need("qk_rope_head_dim"),
        v_head_dim=need("v_head_dim"), intermediate_size=need("intermediate_size"),
        rms_norm_eps=positive_float("rms_norm_eps", 1e-6), rope=_rope(raw, where),
        max_position_embeddings=need("max_position_embeddings"),
        rope_interleave=bool(raw.get("rope_interleave", True)),
        attention_bias=bool(raw.get("attention_bias", False)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers") or 0),
        quantization=_quant(raw, where), extra=raw, **moe)


def load_config(path: str | os.PathLike) -> MLAConfig:
    """Read ``path`` (a config.json or the directory holding one)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        raw = json.loads(path.read_text("utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: not valid JSON ({err})") from None
    return parse_config(raw, str(path))
