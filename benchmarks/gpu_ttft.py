"""Live-PIC TTFT on DeepSeek-V2-Lite shapes (issue #5's benchmark, first cut: plain-torch engine).

agent_meta traffic: every request is a fresh per-agent header of H tokens followed by the same
long body of real agent text (the shipped sample logs, DeepSeek tokenizer, ids folded into the
model's vocabulary: the weights are random, only the timing matters). Per (prompt length, H), over
``--requests`` requests after warm-ups, time to first token of:

    no cache      a full prefill of the prompt
    exact prefix  the engine in ``off`` mode (the header differs at token 0: nothing is reused)
    PIC live      the engine in ``live`` mode (the body comes from the registry, k_r rotated)
    ideal         only the novel tokens prefilled, the body already cached at its positions

Random bf16 weights of the real shapes are made on the GPU (no download); ``--model DIR`` takes a
real checkpoint instead. Prints a table and writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import datetime, timezone
from functools import partial

import numpy as np
import torch

from irminsul.engine import Engine
from irminsul.model import MLAModel, load_model, parse_config
from irminsul.traffic.logs import sample_logs
from irminsul.traffic.prompt import message_tokens
from irminsul.traffic.render import ChatRenderer

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


def random_model(device: str) -> MLAModel:
    """V2-Lite shapes, random bf16 weights made on the device (norms 1, routers fp32)."""
    torch.set_default_dtype(torch.bfloat16)  # build the 15.7B parameters in bf16 directly
    try:
        with torch.device("meta"):
            model = MLAModel(parse_config(V2_LITE))
    finally:
        torch.set_default_dtype(torch.float32)
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    for name, p in model.named_parameters():
        if ".mlp.gate." in name:
            p.data = p.data.float()  # routers stay float32, as the loader keeps them
    model.fuse_experts()
    return model.eval()


def agent_text(vocab: int) -> np.ndarray:
    """Real agent tokens: the shipped sample logs' distinct messages, folded into the vocab."""
    return message_tokens(ChatRenderer.default(), sample_logs()) % vocab


def timed(fn, *args):
    """(seconds, result) of fn(*args), the GPU drained before and after."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn(*args)
    torch.cuda.synchronize()
    return time.perf_counter() - start, result


def ideal(model: MLAModel, ids: torch.Tensor, header: int, body_rows: list) -> None:
    """Only the novel tokens: the header prefills, the body is already cached at its positions,
    and the last prompt token gets its logits against everything."""
    length = ids.shape[0]
    head = model.forward(ids[:header], torch.arange(header))
    context = [torch.cat([h, b[header:-1]]) for h, b in zip(head.latents, body_rows)]
    model.forward(ids[-1:], torch.tensor([length - 1]), context)


def cell(model: MLAModel, text: np.ndarray, length: int, header: int, requests: int,
         warmup: int) -> dict:
    body = text[:length - header]
    rng = np.random.default_rng(length + header)
    prompts = [np.concatenate([text[o:o + header], body]) for o in
               rng.integers(length, text.size - header, requests + warmup)]
    resets = [header]  # the body starts a new message
    slots = 4 * length + 64
    engines = {mode: Engine(model, num_slots=slots, mode=mode) for mode in ("off", "live")}
    times: dict[str, list[float]] = {"no cache": [], "exact prefix": [], "PIC live": [],
                                     "ideal": []}
    served = []
    body_rows = model.forward(torch.from_numpy(prompts[0]), torch.arange(length)).latents
    for i, prompt in enumerate(prompts):
        ids = torch.from_numpy(prompt)
        sample = {"no cache": timed(model.forward, ids, torch.arange(length))[0]}
        for name, engine in (("exact prefix", engines["off"]), ("PIC live", engines["live"])):
            sample[name], (seq, _) = timed(engine.prefill, prompt, resets)
            if name == "PIC live":
                served.append(seq.stats.pic_tokens / length)
            engine.finish(seq)
        sample["ideal"] = timed(ideal, model, ids, header, body_rows)[0]
        if i >= warmup:
            for name, seconds in sample.items():
                times[name].append(seconds)
    for engine in engines.values():
        engine.check()
    result = {"prompt_tokens": length, "header_tokens": header, "requests": requests,
              "pic_served_share": float(np.median(served[warmup:]))}
    for name, values in times.items():
        result[name] = {"p50_ms": 1e3 * statistics.median(values),
                        "p95_ms": 1e3 * float(np.percentile(values, 95))}
    live, ideal_p50 = result["PIC live"]["p50_ms"], result["ideal"]["p50_ms"]
    result["live_over_ideal"] = live / ideal_p50
    result["exact_prefix_over_live"] = result["exact prefix"]["p50_ms"] / live
    return result


def transformers_ttft(lengths: list[int], text: np.ndarray, requests: int) -> dict[int, dict]:
    """What a user would otherwise run: transformers' DeepseekV2ForCausalLM with the same random
    shapes (its own initialisation), a full prefill per request; median/p95 ms per length."""
    import transformers

    config = transformers.AutoConfig.for_model(**V2_LITE)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = transformers.DeepseekV2ForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    out = {}
    for length in lengths:
        ids = torch.from_numpy(text[:length]).cuda()[None]
        with torch.inference_mode():
            prefill = partial(model, ids, logits_to_keep=1)
            values = [timed(prefill)[0] for _ in range(requests + 1)][1:]  # first: warm-up
        out[length] = {"p50_ms": 1e3 * statistics.median(values),
                       "p95_ms": 1e3 * float(np.percentile(values, 95))}
        print(f"L={length:>6} transformers full prefill {out[length]['p50_ms']:8.1f} ms",
              flush=True)
    return out


def decode_rate(model: MLAModel, text: np.ndarray, length: int, header: int, batch: int,
                tokens: int) -> dict[str, float]:
    """Decode tokens/s of ``batch`` concurrent agent_meta requests, PIC live vs off: every
    request is prefilled first (timed apart), then the decode steps alone are timed."""
    from irminsul.engine import SamplingParams, Scheduler

    body = text[:length - header]
    out = {}
    for mode in ("off", "live"):
        scheduler = Scheduler(Engine(model, num_slots=(length + tokens) * (batch + 1), mode=mode),
                              batch_tokens=length + batch, chunk_tokens=length)
        for i in range(batch):
            start = length + i * header
            scheduler.add(np.concatenate([text[start:start + header], body]),
                          SamplingParams(max_tokens=tokens), resets=[header])
        while scheduler.waiting or any(r.state == "prefill" for r in scheduler.running):
            scheduler.step()
        produced, seconds = 0, 0.0
        while scheduler.has_work():
            elapsed, outputs = timed(scheduler.step)
            seconds += elapsed
            produced += sum(len(o.new_tokens) for o in outputs)
        out[mode] = produced / seconds
    out["live_over_off"] = out["live"] / out["off"]
    print(f"decode, {batch} requests x {tokens} tokens at L={length}: off {out['off']:.1f} "
          f"tok/s, live {out['live']:.1f} tok/s ({out['live_over_off']:.3f}x)", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a real checkpoint directory (default: random V2-Lite)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--headers", type=int, nargs="+", default=[50, 2000])
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", help="write the results as JSON")
    parser.add_argument("--decode", action="store_true",
                        help="only decode throughput, PIC live vs off (8 requests x 32 tokens)")
    parser.add_argument("--transformers", action="store_true",
                        help="only the transformers baseline row (full prefill per length)")
    args = parser.parse_args()
    if args.decode:
        model = random_model("cuda")
        rows = [decode_rate(model, agent_text(V2_LITE["vocab_size"]), length, 250, 8, 32)
                for length in args.lengths]
        if args.out:
            with open(args.out, "w", encoding="utf-8") as f:
                json.dump({"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                           "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                           "decode_tokens_per_s": dict(zip(args.lengths, rows))}, f, indent=1)
        return
    if args.transformers:
        rows = transformers_ttft(args.lengths, agent_text(V2_LITE["vocab_size"]), args.requests)
        if args.out:
            with open(args.out, "w", encoding="utf-8") as f:
                json.dump({"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                           "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                           "transformers_full_prefill": rows}, f, indent=1)
        return
    model = (load_model(args.model, dtype=torch.bfloat16, device="cuda") if args.model
             else random_model("cuda"))
    text = agent_text(model.config.vocab_size)
    rows = []
    for length in args.lengths:
        for header in args.headers:
            rows.append(cell(model, text, length, header, args.requests, args.warmup))
            r = rows[-1]
            print(f"L={length:>6} H={header:>5}  PIC served {100 * r['pic_served_share']:5.1f}%  "
                  + "  ".join(f"{k} {r[k]['p50_ms']:8.1f}/{r[k]['p95_ms']:8.1f} ms"
                              for k in ("no cache", "exact prefix", "PIC live", "ideal"))
                  + f"  live/ideal {r['live_over_ideal']:.2f}x"
                  f"  prefix/live {r['exact_prefix_over_live']:.2f}x", flush=True)
    if args.out:
        meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                "model": args.model or "random DeepSeek-V2-Lite shapes, bf16",
                "engine": "plain torch (no custom kernels yet)", "cells": rows}
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=1)


if __name__ == "__main__":
    main()
