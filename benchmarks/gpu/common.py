"""Shared pieces of the GPU suite and its sections: the model under test, real agent text, timing.

The model is DeepSeek-V2-Lite's exact shapes with random weights made on the device (no
download), a real checkpoint directory, or (``tiny``) a two-layer stand-in with the same
structure that runs on a CPU in CI.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from typing import Any, NamedTuple, TypeVar

import numpy as np
import torch

from irminsul.model import MLAModel, load_model, parse_config
from irminsul.model.random_weights import random_model as random_weights_model
from irminsul.traffic.logs import sample_logs
from irminsul.traffic.prompt import distinct_messages
from irminsul.traffic.render import ChatRenderer

T = TypeVar("T")

# DeepSeek-V2-Lite's config.json (public; deepseek-ai/DeepSeek-V2-Lite), the fields we read.
V2_LITE = dict(
    model_type="deepseek_v2", vocab_size=102400, hidden_size=2048, num_hidden_layers=27,
    num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, intermediate_size=10944,
    moe_intermediate_size=1408, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
    first_k_dense_replace=1, moe_layer_freq=1, n_group=1, topk_group=1, topk_method="greedy",
    scoring_func="softmax", norm_topk_prob=False, routed_scaling_factor=1.0, rms_norm_eps=1e-6,
    max_position_embeddings=163840, rope_theta=10000,
    rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096,
                      beta_fast=32, beta_slow=1, mscale=0.707, mscale_all_dim=0.707))
# The same structure (dense first layer, shared + routed experts, YaRN, 64-dim k_r) at a size a
# CPU runs in milliseconds: the CI smoke test's model.
TINY = dict(V2_LITE, vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, kv_lora_rank=32, qk_nope_head_dim=16, v_head_dim=16,
            intermediate_size=96, moe_intermediate_size=24, n_routed_experts=8,
            num_experts_per_tok=2, n_shared_experts=1)


def random_model(raw: dict[str, Any], device: str, dtype: torch.dtype = torch.bfloat16) -> MLAModel:
    """The config's shapes with random weights made on the device (norms 1, routers fp32)."""
    return random_weights_model(parse_config(raw), device, dtype)


def build_model(device: str, *, tiny: bool = False, checkpoint: str | None = None) -> MLAModel:
    """The model under test: a checkpoint directory, the tiny stand-in (float32, for CPUs), or
    random V2-Lite shapes in bf16."""
    if checkpoint:
        return load_model(checkpoint, dtype=torch.bfloat16, device=device)
    return random_model(TINY, device, torch.float32) if tiny else random_model(V2_LITE, device)


def model_config(tiny: bool) -> dict[str, Any]:
    """The raw config the random model is built from."""
    return TINY if tiny else V2_LITE


class AgentText:
    """Real agent text: the shipped sample logs' distinct messages back to back (DeepSeek
    tokenizer), ids folded into the model's vocabulary (the weights are random, only timing
    matters), with the position where each message starts."""

    def __init__(self, vocab: int) -> None:
        pieces = distinct_messages(ChatRenderer.default(), sample_logs())
        self.vocab = vocab
        self.tokens = np.concatenate(pieces).astype(np.int64) % vocab
        self.starts = np.cumsum([0] + [p.size for p in pieces[:-1]])

    def starts_in(self, start: int, end: int) -> np.ndarray:
        """Message starts strictly inside tokens [start, end), relative to ``start``."""
        inside = self.starts[(self.starts > start) & (self.starts < end)]
        return inside - start


def decode_lengths(batch: int, context: int, ragged: bool) -> np.ndarray:
    """Each decode request's keys: ``context`` for all, or (ragged) drawn log-uniformly between
    256 and ``context`` with a seed of the batch, so every benchmark draws the same batches."""
    if not ragged:
        return np.full(batch, context)
    rng = np.random.default_rng(batch)
    return np.exp(rng.uniform(np.log(256), np.log(context), batch)).astype(int)


def sync(device: torch.device | str) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device | str, fn: Callable[..., T], *args: Any) -> tuple[float, T]:
    """(seconds, result) of fn(*args), the device drained before and after."""
    sync(device)
    start = time.perf_counter()
    result = fn(*args)
    sync(device)
    return time.perf_counter() - start, result


class CallTime(NamedTuple):
    """Seconds per call of back-to-back calls."""

    device: float  # the device's time: a kernel's own, as inside a forward
    issue: float  # the host's time to issue one (launch overhead; the device's on a CPU)


def per_call(device: torch.device | str, fn: Callable[[], Any], calls: int = 10) -> CallTime:
    """Time ``calls`` back-to-back calls. On a GPU a spin kernel holds the queue while the host
    issues them and device events time them: a short kernel would otherwise be timed by how fast
    the host launches it, not by the device (inside a forward earlier kernels keep the device
    busy while the next is issued; the engine's own launch costs are in the TTFT figures).
    Elsewhere wall time."""

    def back_to_back() -> None:
        for _ in range(calls):
            fn()

    if torch.device(device).type != "cuda":
        wall = timed(device, back_to_back)[0] / calls
        return CallTime(wall, wall)
    sync(device)
    start = time.perf_counter()
    back_to_back()  # also the warm-up: how long the host takes to issue them
    issue = time.perf_counter() - start
    sync(device)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(int((2 * issue + 1e-3) * _sleep_cycles_per_second(device)))
    begin.record()
    back_to_back()
    end.record()
    end.synchronize()
    return CallTime(begin.elapsed_time(end) / 1e3 / calls, issue / calls)


_CYCLES: dict[str, float] = {}


def _sleep_cycles_per_second(device: torch.device | str) -> float:
    """The rate of ``torch.cuda._sleep``'s spin (the SM clock), measured once per device."""
    key = str(device)
    if key not in _CYCLES:
        cycles = 10**7
        torch.cuda._sleep(cycles // 10)  # warm-up
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        _CYCLES[key] = cycles / (begin.elapsed_time(end) / 1e3)
    return _CYCLES[key]


def percentiles(values: Sequence[float], scale: float = 1.0, unit: str = "ms") -> dict[str, float]:
    """p50 and p95 of values times ``scale``, keyed ``p50_<unit>``/``p95_<unit>``."""
    return {f"p50_{unit}": scale * statistics.median(values),
            f"p95_{unit}": scale * float(np.percentile(values, 95))}


def run_metadata(device: str) -> dict[str, str]:
    """Date, machine and software the figures were measured with."""
    name = torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else "cpu"
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device": name,
            "torch": torch.__version__}
