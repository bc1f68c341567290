"""Repair on the latent: what recomputing some reused tokens buys, against how many it recomputes.

Two repair rules (``irminsul/engine/repair.py``), each a :class:`~irminsul.config.CacheConfig`
knob, in this prompt's context instead of reused, the rest of each run still reused with k_r
rotated by δ:

* EPIC-style, ``recompute_head`` = k: the first k tokens of every reused run (k = 0 is no repair);
* CacheBlend-style, ``recompute_share`` = r: the share r of the reused tokens whose c_KV at layer
  1 deviates most from a fresh computation (a check forward of the prompt through layer 0).

and, to see what rankings no server has yet would buy, two oracles (``--oracle``) and an
emulated two-pass rule (``--attended``: :func:`attended_ranking`).

For each workload (the five partition-shift patterns, as ``bench serve`` builds them from the
shipped samples) and each setting, every request is served in order by a persistent live
engine (so each request sees what the earlier ones registered, as in serving) and compared with
full recomputation, as ``irminsul consistency`` does: KL(full ‖ served) and argmax match over a
teacher-forced continuation, the first divergence of free-running greedy decoding; beside them
the share of the unrepaired reused tokens that repair computed instead, and the prefill's wall
time (the TTFT of a request served alone: the check forward and the recomputed tokens are what
repair adds). Over the requests whose prompt got a registry hit without repair. Per workload
also the floor: KL of the same requests served by an engine with PIC off (no reuse), what the
served path's own arithmetic costs against the reference; no repair can go below it. The
embedded model runs in float32 on a CPU and in bfloat16 on a GPU.

The model is the embedded default unless ``--model`` names a checkpoint; ``--random-weights``
runs DeepSeek-V2-Lite's shapes with random weights (bf16; for the TTFT each setting costs on a
GPU: its KL figures mean nothing).

    python benchmarks/cpu/repair.py [--heads 0 2 4 8 16 32] [--shares 0.05 0.10 0.15]
                                    [--check-layers 1] [--workloads agent_meta ...]
                                    [--requests 12] [--tokens 16]
                                    [--recent 0.05] [--recent-heads 32] [--budgets 0 0.1]
                                    [--attended 0.05]
                                    [--model DIR | --random-weights] [--device cpu|cuda] [--heal]
                                    [--out F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
from common import V2_LITE, random_model, run_metadata  # noqa: E402

from irminsul.analysis.consistency import full_continuation, render_prompts, serve  # noqa: E402
from irminsul.config import CacheConfig, EngineConfig  # noqa: E402
from irminsul.engine import Engine  # noqa: E402
from irminsul.loadgen.workloads import load_workload  # noqa: E402
from irminsul.model import MLAModel, default_model_dir, load_model  # noqa: E402
from irminsul.traffic.render import ChatRenderer  # noqa: E402
from irminsul.traffic.workloads import PATTERNS  # noqa: E402


def settings(heads: list[int], shares: list[float], check_layers: list[int],
             oracle: list[float] | None = None,
             signed: list[float] | None = None, recent: list[float] | None = None,
             recent_heads: list[int] | None = None,
             budgets: list[float] | None = None,
             attended: list[float] | None = None) -> list[dict[str, Any]]:
    """The repair settings measured, no repair (EPIC k = 0) first: every ratio is against it."""
    out = [{"method": "epic", "recompute_head": k} for k in sorted(set(heads) | {0})]
    out += [{"method": "cacheblend", "recompute_share": r, "check_layer": layer}
            for layer in check_layers for r in shares]
    out += [{"method": "signed", "recompute_share": r, "check_layer": layer}
            for layer in check_layers for r in signed or []]
    out += [{"method": "recent", "recompute_share": r, "recompute_head": k, "check_layer": 1,
             "recompute_budget": b}
            for b in budgets or [0.0] for k in recent_heads or [0] for r in recent or []
            if not b or (k and r <= b)]
    out += [{"method": "attended", "recompute_share": r, "recompute_head": k, "check_layer": 1,
             "recompute_budget": b}
            for b in budgets or [0.0] for k in recent_heads or [0] for r in attended or []
            if not b or (k and r <= b)]
    return out + [{"method": method, "recompute_share": r, "check_layer": 1}
                  for method in ("oracle", "gradient") for r in oracle or []]


def label(setting: dict[str, Any]) -> str:
    if setting["method"] == "epic":
        return f"EPIC k={setting['recompute_head']}"
    if setting["method"] in ("recent", "attended"):
        head = setting["recompute_head"]
        budget = setting.get("recompute_budget", 0.0)
        return (f"{setting['method']} r={setting['recompute_share']:.0%}"
                + (f" + EPIC k={head}" if head else "")
                + (f" within {budget:.0%}" if budget else ""))
    if setting["method"] in ("oracle", "gradient"):
        return f"{setting['method']} r={setting['recompute_share']:.0%}"
    layer = setting["check_layer"]
    name = "CacheBlend" if setting["method"] == "cacheblend" else "signed"
    return f"{name} r={setting['recompute_share']:.0%}" + (f" @L{layer}" if layer != 1 else "")


def cache_config(setting: dict[str, Any], heal: bool = False) -> CacheConfig:
    if setting["method"] == "epic":
        return CacheConfig(recompute_head=setting["recompute_head"], heal=heal)
    if setting["method"] in ("recent", "attended"):  # attended: its ranking replaces recent's
        return CacheConfig(recompute_head=setting["recompute_head"],
                           recompute_share=setting["recompute_share"], recompute_rule="recent",
                           recompute_budget=setting.get("recompute_budget", 0.0), heal=heal)
    # The oracles replace the deviation rule's check (oracle_deviation, gradient_deviation).
    rule = "signed" if setting["method"] == "signed" else "deviation"
    return CacheConfig(recompute_share=setting["recompute_share"], recompute_rule=rule,
                       recompute_check_layer=setting["check_layer"], heal=heal)


def timed_prefills(engine: Engine, times: list[float]) -> None:
    """Record the wall time of each of the engine's prefills (synchronised on CUDA, so it is
    the time to the first token's logits)."""
    prefill, cuda = engine.prefill, engine.model.lm_head.weight.is_cuda

    def timed(*args: Any, **kwargs: Any):
        started = time.perf_counter()
        result = prefill(*args, **kwargs)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
        return result

    engine.prefill = timed  # serve() calls engine.prefill once per request


def counted_checks(engine: Engine, lengths: list[int]) -> None:
    """Record the tokens each check forward of CacheBlend-style repair runs through its layers
    (the prompt up to its last reused token)."""
    check = engine.cache.latent_check
    if check is None or engine.config.cache.recompute_rule == "recent":  # no check forward
        return

    def counted(prompt: Any, positions: Any, slots: Any) -> Any:
        lengths.append(int(positions.max()) + 1)
        return check(prompt, positions, slots)

    engine.cache.latent_check = counted


def oracle_deviation(model: MLAModel, engine: Engine) -> None:
    """Replace the engine's check forward by an oracle no server has: each reused token's c_KV
    deviation at *every* layer, from a full forward of the prompt, each layer's squared
    distance divided by that layer's mean squared fresh row (so no layer wins by its scale),
    summed. It ranks tokens by how far their served rows are from the rows full recomputation
    computes (CacheBlend's criterion without its one-layer proxy): the bound on what ranking
    by deviation can buy. Its cost (a full prefill) is not counted."""
    ckv = engine.runner.ckv
    rank = ckv.shape[2]

    def deviation(prompt: Any, positions: Any, slots: Any) -> Any:
        length = int(positions.max()) + 1
        ids = torch.as_tensor(prompt[:length], dtype=torch.long)
        latents = model.forward(ids, torch.arange(length)).latents
        where = torch.as_tensor(positions, dtype=torch.long)
        at = torch.as_tensor(slots, dtype=torch.long, device=ckv.device)
        score = torch.zeros(len(positions), dtype=torch.float64)
        for layer in range(1, len(latents)):  # layer 0's rows are exact
            fresh = latents[layer][:, :rank].double().cpu()
            served = ckv[layer, at].double().cpu()
            scale = fresh.pow(2).sum(-1).mean()
            score += (fresh[where] - served).pow(2).sum(-1) / scale
        return score.numpy()

    engine.cache.latent_check = deviation


def served_state(model: MLAModel, ckv: torch.Tensor, prompt: Any, positions: Any, slots: Any
                 ) -> tuple[int, Any, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """The oracles' emulation of what a prompt's context is served: a full forward of the
    prompt but its last token, each layer's rows fresh but the reused tokens' c_KV, which are
    the cached rows at ``slots``. (length, which ``positions`` lie inside it, those positions,
    the fresh rows per layer, the served rows per layer.)"""
    rank = ckv.shape[2]
    length = prompt.size - 1  # the context; the last prompt token reads it
    latents = model.forward(torch.as_tensor(prompt[:length], dtype=torch.long),
                            torch.arange(length)).latents
    inside = positions < length
    where = torch.as_tensor(positions[inside], dtype=torch.long)
    at = torch.as_tensor(slots[inside], dtype=torch.long, device=ckv.device)
    served = []
    for layer, fresh in enumerate(latents):
        rows = fresh.clone()
        rows[where, :rank] = ckv[layer, at].to(fresh.dtype).to(fresh.device)
        served.append(rows)
    return length, inside, where, list(latents), served


def gradient_deviation(model: MLAModel, engine: Engine,
                       references: dict[bytes, tuple[list[int], torch.Tensor]]) -> None:
    """Replace the engine's check forward by a second oracle: each reused token ranked by how
    much replacing its cached c_KV rows (every layer) by the fresh ones lowers the KL of the
    teacher-forced continuation, to first order: the gradient of that KL with respect to the
    served rows, dotted with (fresh − cached). The served state is approximated by fresh rows
    everywhere but the reused tokens' c_KV. Ranks by effect on the output, not by distance;
    its cost (a full prefill and a backward pass) is not counted."""
    ckv = engine.runner.ckv
    rank = ckv.shape[2]
    body = model.model

    def deviation(prompt: Any, positions: Any, slots: Any) -> Any:
        continuation, reference = references[np.asarray(prompt, dtype=np.int64).tobytes()]
        # The last prompt token starts the continuation.
        length, inside, where, latents, context = served_state(model, ckv, prompt, positions,
                                                                slots)
        deltas = [fresh[where, :rank] - served[where, :rank]
                  for fresh, served in zip(latents, context)]
        context = [served.requires_grad_(True) for served in context]
        ids = torch.as_tensor([int(prompt[-1]), *continuation[:-1]], dtype=torch.long)
        at_positions = torch.arange(length, length + ids.numel())
        with torch.enable_grad():
            x = body.embed_tokens(ids)
            for layer, rows in zip(body.layers, context):
                x, _ = layer(x, at_positions, [rows], [ids.numel()], None)
            logits = model.lm_head(body.norm(x)).float()
            loss = (reference.softmax(-1) * (reference.log_softmax(-1)
                                             - logits.log_softmax(-1))).sum()
            grads = torch.autograd.grad(loss, context)
        gain = torch.zeros(len(positions), dtype=torch.float64)
        drop = torch.zeros(int(inside.sum()), dtype=torch.float64)
        for grad, delta in zip(grads, deltas):
            drop -= (grad[where, :rank] * delta).sum(-1).double()  # first-order KL decrease
        gain[torch.as_tensor(inside)] = drop
        return gain.numpy()

    engine.cache.latent_check = deviation


def attended_ranking(model: MLAModel, engine: Engine) -> None:
    """Replace the engine's ranking by an emulation of a two-pass rule no server runs yet: each
    reused token scored by the attention the prompt's last token pays it over the served rows,
    summed over the layers above 0 (mean over heads). The served state is emulated as
    :func:`gradient_deviation` emulates it — a full forward's rows, the reused tokens' c_KV
    swapped for the cached rows they are served — so its cost (a full prefill) is not counted;
    a server would take the scores from the PIC prefill itself and then compute the picked
    tokens and the tail again."""
    ckv = engine.runner.ckv
    body = model.model
    from irminsul.studies.attention import AttentionProbe

    def score(prompt: Any, positions: Any, slots: Any) -> Any:
        length, _, _, _, context = served_state(model, ckv, prompt, positions, slots)
        last = torch.as_tensor(prompt[length:], dtype=torch.long)
        with torch.no_grad(), AttentionProbe(model) as probe:
            x = body.embed_tokens(last)
            for layer, rows in zip(body.layers, context):
                x, _ = layer(x, torch.arange(length, length + 1), [rows], [1], None)
        received = sum(p[:, 0, :length].mean(0).double().cpu() for p in probe.layers[1:])
        return received.numpy()[np.minimum(positions, length - 1)]

    engine.cache.latent_check = score


def measure(model: MLAModel, renderer: ChatRenderer, workload: str, repairs: list[dict],
            requests: int, tokens: int, heal: bool = False) -> dict[str, Any]:
    """Per setting: mean KL, argmax match, first divergence and prefill time over the requests
    with hits, and the share of the unrepaired reused tokens computed instead. ``heal``: each
    engine heals after every request (idle time, outside the request: not counted as
    recomputed)."""
    chosen = load_workload(workload, renderer)[:requests]
    prompts = render_prompts(renderer, chosen, model.config.vocab_size)
    references = [full_continuation(model, p.tokens, tokens) for _, p in prompts]
    slots = sum(p.size + 2 * tokens for _, p in prompts)
    layers = model.config.num_hidden_layers
    served_by = []
    for setting in repairs:
        engine = Engine(model, EngineConfig(slots=slots, mode="live",
                                            cache=cache_config(setting, heal)))
        if setting["method"] == "oracle":
            oracle_deviation(model, engine)
        if setting["method"] == "attended":
            attended_ranking(model, engine)
        if setting["method"] == "gradient":
            gradient_deviation(model, engine, {p.tokens.astype(np.int64).tobytes(): ref
                                               for (_, p), ref
                                               in zip(prompts, references)})
        times: list[float] = []
        timed_prefills(engine, times)
        checks: list[int] = []
        counted_checks(engine, checks)
        check_layer = engine.config.cache.recompute_check_layer
        served = []
        for (_, prompt), (continuation, logits) in zip(prompts, references):
            before = len(checks)
            served.append(serve(engine, prompt, continuation, logits))
            if heal:
                engine.heal()
            # Token-layers the prefill ran: its computed tokens through every layer, the check
            # forward's tokens through the layers below the check layer.
            served[-1]["token_layers"] = (served[-1]["prefilled_tokens"] * layers
                                          + sum(checks[before:]) * check_layer)
        for row, seconds in zip(served, times):
            row["prefill_s"] = seconds
        engine.check()
        served_by.append(served)
    # The floor: the same requests served with no reuse (PIC off), so all that differs from the
    # reference is the served path's arithmetic (kernels, summation order, a router's near-ties),
    # not reuse. No repair can go below it.
    engine = Engine(model, EngineConfig(slots=slots, mode="off"))
    floor = [serve(engine, prompt, continuation, logits)["kl"]
             for (_, prompt), (continuation, logits) in zip(prompts, references)]
    engine.check()
    def reused_of(s: dict[str, Any]) -> int:
        # A derived prefix (an earlier turn's reused rows, matched in the radix tree) is reused
        # too, and the deviating rule's candidate since 2026-12-02.
        return s["pic_tokens"] + s.get("derived_prefix_tokens", 0)

    hit = [i for i, s in enumerate(served_by[0]) if reused_of(s)]
    reused = sum(reused_of(served_by[0][i]) for i in hit)
    rows = []
    for setting, served in zip(repairs, served_by):
        picked = [served[i] for i in hit]

        def mean(key: str) -> float | None:
            return statistics.fmean(s[key] for s in picked) if picked else None  # noqa: B023

        rows.append({**setting,
                     "recomputed_share": (1 - sum(reused_of(s) for s in picked) / reused)
                     if reused else 0.0,
                     "kl": mean("kl"), "argmax": mean("argmax"),
                     "first_divergence": mean("first_divergence"), "prefill_s": mean("prefill_s"),
                     "token_layers": sum(s["token_layers"] for s in picked)})
    base = rows[0]
    for row in rows:  # against no repair, in the same run
        row["kl_vs_none"] = row["kl"] / base["kl"] if base["kl"] else None
        row["prefill_vs_none"] = (row["prefill_s"] / base["prefill_s"]
                                  if base["prefill_s"] else None)
        row["compute_vs_none"] = (row["token_layers"] / base["token_layers"]
                                  if base["token_layers"] else None)
    return {"workload": workload, "requests": len(prompts), "requests_with_hits": len(hit),
            "reused_tokens": reused,
            "floor_kl": statistics.fmean(floor[i] for i in hit) if hit else None, "rows": rows}


def summary(workloads: list[dict], repairs: list[dict], cap: float) -> list[dict[str, Any]]:
    """Per setting, over the workloads with hits: the mean of each figure, the largest share
    recomputed, the worst (largest) KL ratio to no repair, and whether it meets the target
    (KL at most half of no repair on every workload, recomputing at most ``cap``)."""
    out = []
    for i, setting in enumerate(repairs):
        rows = [w["rows"][i] for w in workloads if w["requests_with_hits"]]
        ratios = [r["kl_vs_none"] for r in rows if r["kl_vs_none"] is not None]
        recomputed = max((r["recomputed_share"] for r in rows), default=0.0)
        worst = max(ratios, default=None)
        out.append({**setting, "label": label(setting), "workloads": len(rows),
                    "recomputed_share": statistics.fmean(r["recomputed_share"] for r in rows),
                    "recomputed_share_max": recomputed,
                    **{key: statistics.fmean(r[key] for r in rows)
                       for key in ("kl", "argmax", "first_divergence", "prefill_vs_none",
                                   "compute_vs_none")},
                    "kl_vs_none_max": worst,
                    "target_met": bool(worst is not None and worst <= 0.5 and recomputed <= cap)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", type=int, nargs="+", default=[0, 2, 4, 8, 16, 32],
                        help="values of recompute_head (k) for EPIC-style repair")
    parser.add_argument("--shares", type=float, nargs="*", default=[0.05, 0.10, 0.15],
                        help="values of recompute_share (r) for CacheBlend-style repair")
    parser.add_argument("--oracle", type=float, nargs="*", default=[],
                        help="shares recomputed by two oracle rankings: every layer's deviation "
                             "from a full forward, and the first-order effect on the output")
    parser.add_argument("--signed", type=float, nargs="*", default=[],
                        help="shares recomputed by the sign-aware check (each --check-layers "
                             "value: the layers it scores)")
    parser.add_argument("--recent", type=float, nargs="*", default=[],
                        help="shares recomputed by the recent rule: the reused tokens nearest "
                        "the prompt's end (recompute_rule 'recent')")
    parser.add_argument("--recent-heads", type=int, nargs="+", default=[0],
                        help="EPIC heads computed with each --recent share as well")
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.0],
                        help="recompute_budget of each --recent or --attended setting with heads "
                        "(0: no cap; the heads shrink so heads and share stay within it)")
    parser.add_argument("--attended", type=float, nargs="*", default=[],
                        help="shares recomputed by an emulated two-pass rule: the reused tokens "
                        "the prompt's last token attends to most over the served rows (with "
                        "--recent-heads and --budgets as the recent rule)")
    parser.add_argument("--check-layers", type=int, nargs="+", default=[1],
                        help="values of recompute_check_layer for CacheBlend-style repair")
    parser.add_argument("--workloads", nargs="+", default=list(PATTERNS), choices=PATTERNS)
    parser.add_argument("--requests", type=int, default=12, help="per workload")
    parser.add_argument("--tokens", type=int, default=16, help="continuation tokens")
    model_group = parser.add_mutually_exclusive_group()
    model_group.add_argument("--model", type=Path, default=None,
                             help="checkpoint directory (default: the embedded model)")
    model_group.add_argument("--random-weights", action="store_true",
                             help="DeepSeek-V2-Lite's shapes, random bf16 weights (TTFT only)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="weights and KV (default: float32 on the CPU, bfloat16 on a GPU)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (torch)")
    parser.add_argument("--heal", action="store_true",
                        help="heal after every request, as an idle server does between turns")
    parser.add_argument("--out", help="results JSON")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.random_weights:
        model, renderer, name = random_model(V2_LITE, args.device), ChatRenderer.default(), \
            "random DeepSeek-V2-Lite"
    else:
        directory = args.model or default_model_dir()
        dtype = getattr(torch, args.dtype) if args.dtype else (
            torch.float32 if args.device == "cpu" else torch.bfloat16)
        model = load_model(directory, dtype=dtype, device=args.device)
        renderer, name = ChatRenderer.from_dir(directory), directory.name
    repairs = settings(args.heads, args.shares, args.check_layers, args.oracle, args.signed,
                       args.recent, args.recent_heads, args.budgets, args.attended)
    started = time.perf_counter()
    workloads = []
    for workload in args.workloads:
        result = measure(model, renderer, workload, repairs, args.requests, args.tokens,
                         args.heal)
        workloads.append(result)
        if args.out:  # what is measured so far, in case a long run is stopped
            Path(args.out).write_text(json.dumps({"workloads": workloads}, indent=1),
                                      encoding="utf-8")
        floor = "" if result["floor_kl"] is None else \
            f"; KL with no reuse (the floor) {result['floor_kl']:.3e}"
        print(f"\n{workload}: {result['requests']} requests, {result['requests_with_hits']} with "
              f"hits, {result['reused_tokens']} reused tokens without repair{floor}")
        print(f"{'setting':>18} {'recomputed':>11} {'KL(full||PIC)':>14} {'vs none':>8} "
              f"{'argmax':>7} {'first div.':>10} {'compute':>9} {'prefill':>9}")
        for r in result["rows"]:
            if r["kl"] is None:
                continue
            print(f"{label(r):>18} {r['recomputed_share']:>10.1%} {r['kl']:>14.3e} "
                  f"{r['kl_vs_none'] or 0:>8.3f} {r['argmax']:>7.3f} "
                  f"{r['first_divergence']:>10.2f} {r['compute_vs_none'] or 0:>8.2f}× "
                  f"{r['prefill_vs_none'] or 0:>8.2f}×")
    cap = 0.10
    report = {"model": name, "device": args.device, "requests": args.requests, "heal": args.heal,
              "tokens": args.tokens, "target": {"recomputed_at_most": cap, "kl_vs_none_at_most":
                                                0.5},
              "workloads": workloads, "summary": summary(workloads, repairs, cap),
              "seconds": round(time.perf_counter() - started, 1), "meta": run_metadata(args.device)}
    argv = sys.argv[1:]
    if "--out" in argv:  # the command that reproduces the file, writing it anywhere
        argv[argv.index("--out") + 1] = "F.json"
    report["meta"]["command"] = " ".join(["python benchmarks/cpu/repair.py", *argv])
    print("\nover the workloads with hits (KL ratio: the worst workload's)")
    for s in report["summary"]:
        print(f"{s['label']:>18} recomputed {s['recomputed_share']:6.1%}  KL {s['kl']:.3e}  "
              f"worst KL/none {s['kl_vs_none_max'] or 0:.3f}  argmax {s['argmax']:.3f}  "
              f"compute {s['compute_vs_none']:.2f}×  prefill {s['prefill_vs_none']:.2f}×  "
              f"target {'met' if s['target_met'] else '-'}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
