"""Fused MoE router: scoring, group limiting, top-k and the weights' normalisation of
DeepSeek-V2/V3 routers in one Triton launch after cuBLAS's logits.

Decode is launch-bound. On an H200 a DeepSeek-V2-Lite decode step ran
:class:`~irminsul.model.moe.Router` as about eight small kernels per MoE layer (cast, GEMV,
softmax, topk as a gather and a bitonic sort, scale), ~17 µs per layer at batch 1. Here the
logits are the Router's own (x.float() · weightᵀ, cuBLAS in float32, bit for bit its values)
and one program per block of tokens does the rest in registers:

1. the logits [T, E], over a power-of-two padded expert axis (padding masked out);
2. scores: softmax (V2) or sigmoid (V3, whose choice adds ``e_score_correction_bias``);
3. group limiting: each group scored (V2: its best score; V3: the sum of its best two biased
   scores), the ``topk_group`` best groups kept, the other experts' scores set to 0 (V2) or their
   choice to -inf (V3);
4. top-k as k rounds of max / lowest-index argmax, already chosen experts masked out: the
   experts in descending order, as torch.topk gives them;
5. the weights renormalised and/or scaled exactly as the Router does, and ``shared`` extra
   columns appended for shared experts folded into the fused MoE kernel as extra experts.

Outputs have sizes fixed by T and nothing is read back to the host, so a CUDA graph captures it.

Ties (equal scores, equal group scores) go to the lowest index. torch.topk leaves tie order
unspecified, so on exact ties the ids may differ from the Router's; random float logits never
tie in practice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .launch import pdl_args, wait_for_previous

METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
# Tokens per program: one block covers decode batches up to 16, larger ones get more programs.
BLOCK_T = 16


@triton.jit
def _router_kernel(LOGITS, BIAS, WEIGHTS, IDS, tokens, scaling, experts_total,
                   E: tl.constexpr, E_P2: tl.constexpr, K: tl.constexpr, SHARED: tl.constexpr,
                   OUT_P2: tl.constexpr, GROUPS: tl.constexpr, TOPK_GROUP: tl.constexpr,
                   G_P2: tl.constexpr, GROUPED: tl.constexpr, SIGMOID: tl.constexpr,
                   RENORM: tl.constexpr, SCALE: tl.constexpr, BLOCK_T: tl.constexpr,
                   PDL: tl.constexpr):
    wait_for_previous(PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < tokens
    experts = tl.arange(0, E_P2)
    expert_ok = experts < E

    # 1. logits [BLOCK_T, E_P2], computed before the launch.
    logits = tl.load(LOGITS + rows[:, None].to(tl.int64) * E + experts[None, :],
                     mask=row_ok[:, None] & expert_ok[None, :], other=0.0)

    # 2. scores (what the weights are read from) and choice (what the experts are chosen by).
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-logits))
        bias = tl.load(BIAS + experts, mask=expert_ok, other=0.0)
        choice = scores + bias[None, :]
    else:
        logits = tl.where(expert_ok[None, :], logits, float("-inf"))
        p = tl.exp(logits - tl.max(logits, 1)[:, None])  # padding: exp(-inf) = 0
        scores = p / tl.sum(p, 1)[:, None]
        choice = scores

    # 3. group limiting. Groups are contiguous runs of E / GROUPS experts; padding experts fall
    # in groups >= GROUPS, which no loop below visits, and are never chosen (step 4 masks them).
    if GROUPED:
        group = experts // (E // GROUPS)
        gcols = tl.arange(0, G_P2)
        gscore = tl.full([BLOCK_T, G_P2], float("-inf"), tl.float32)
        for g in tl.static_range(GROUPS):
            member = (group == g)[None, :]
            best = tl.max(tl.where(member, choice, float("-inf")), 1)
            if SIGMOID and E // GROUPS >= 2:  # V3: the best two; the Router's topk(min(2, size))
                first = tl.min(tl.where(member & (choice == best[:, None]), experts[None, :], E_P2),
                               1)
                others = member & (experts[None, :] != first[:, None])
                best += tl.max(tl.where(others, choice, float("-inf")), 1)
            gscore = tl.where(gcols[None, :] == g, best[:, None], gscore)
        # A group's rank: the groups ahead of it (higher score, or equal with a lower index).
        # G_P2² lanes per token, tiny beside the expert tiles.
        mine, theirs = gscore[:, :, None], gscore[:, None, :]
        ahead = (theirs > mine) | ((theirs == mine) & (gcols[None, None, :] < gcols[None, :, None]))
        kept = (tl.sum(ahead.to(tl.int32), 2) < TOPK_GROUP).to(tl.int32)  # [BLOCK_T, G_P2]
        keep = tl.zeros([BLOCK_T, E_P2], tl.int32)
        for g in tl.static_range(GROUPS):
            kept_g = tl.max(tl.where(gcols[None, :] == g, kept, 0), 1)
            keep += tl.where((group == g)[None, :], kept_g[:, None], 0)
        if SIGMOID:
            choice = tl.where(keep > 0, choice, float("-inf"))
        else:
            choice = tl.where(keep > 0, choice, 0.0)  # V2 zeroes the scores: they are the weights

    # 4. top-k: K rounds of max and lowest-index argmax over the experts not yet chosen (a mask,
    # not a -inf fill: V3's dropped groups already hold -inf and may still be needed).
    cols = tl.arange(0, OUT_P2)
    out_w = tl.zeros([BLOCK_T, OUT_P2], tl.float32)
    out_id = tl.zeros([BLOCK_T, OUT_P2], tl.int32)
    avail = tl.broadcast_to(expert_ok[None, :], [BLOCK_T, E_P2])
    for j in tl.static_range(K):
        cand = tl.where(avail, choice, float("-inf"))
        best = tl.max(cand, 1)
        pick = tl.min(tl.where(avail & (cand == best[:, None]), experts[None, :], E_P2), 1)
        hit = experts[None, :] == pick[:, None]
        if SIGMOID:  # V3 weighs by the unbiased score; the bias only chooses
            weight = tl.sum(tl.where(hit, scores, 0.0), 1)
        else:
            weight = best
        out_w = tl.where(cols[None, :] == j, weight[:, None], out_w)
        out_id = tl.where(cols[None, :] == j, pick[:, None], out_id)
        avail = avail & (hit == 0)

    # 5. normalisation, in the Router's order of operations (renormalise, then scale).
    routed = (cols < K)[None, :]
    if RENORM:
        total = tl.sum(tl.where(routed, out_w, 0.0), 1)
        out_w = out_w / (total[:, None] + 1e-20)
    if SCALE:
        out_w = out_w * scaling
    shared = ((cols >= K) & (cols < K + SHARED))[None, :]
    out_w = tl.where(shared, 1.0, out_w)
    out_id = tl.where(shared, experts_total + cols[None, :] - K, out_id)
    at = rows[:, None].to(tl.int64) * (K + SHARED) + cols[None, :]
    ok = row_ok[:, None] & (cols < K + SHARED)[None, :]
    tl.store(WEIGHTS + at, out_w, mask=ok)
    tl.store(IDS + at, out_id, mask=ok)


def route(x: torch.Tensor, weight: torch.Tensor, *, top_k: int, method: str, groups: int,
          topk_group: int, norm: bool, scaling: float, bias: torch.Tensor | None = None,
          shared: int = 0, experts_total: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing weights float32 [T, top_k + shared] and expert ids int32 [T, top_k + shared] for
    tokens ``x`` [T, D] (any float dtype, last dim contiguous, any row stride).

    The first ``top_k`` columns are :class:`~irminsul.model.moe.Router`'s output, in its order
    (descending choice): ``weight`` [E, D] float32 is its weight, ``method`` its ``topk_method``
    ("greedy", "group_limited_greedy": DeepSeek-V2; "noaux_tc": V3, which needs ``bias`` [E]
    float32, its ``e_score_correction_bias``), ``groups`` / ``topk_group`` its ``n_group`` /
    ``topk_group``, ``norm`` / ``scaling`` its ``norm_topk_prob`` / ``routed_scaling_factor``.
    Each of the ``shared`` columns after them holds one shared expert, id ``experts_total + j``
    (default E + j), weight 1.0. Ties go to the lowest index (torch.topk's order is unspecified).
    Two launches (the logits' GEMV, then the rest), nothing read back to the host; T = 0
    launches nothing."""
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} must be [T, D] and weight {tuple(weight.shape)} "
                         "[E, D]")
    if not x.is_floating_point() or weight.dtype != torch.float32:
        raise ValueError(f"x must be floating point (got {x.dtype}) and weight float32 (got "
                         f"{weight.dtype})")
    experts = weight.shape[0]
    if method not in METHODS:
        raise ValueError(f"method {method!r} is not one of {', '.join(METHODS)}")
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k ({top_k}) must be between 1 and the {experts} experts")
    if groups < 1 or experts % groups:
        raise ValueError(f"groups ({groups}) must divide the {experts} experts")
    if not 1 <= topk_group <= groups:
        raise ValueError(f"topk_group ({topk_group}) must be between 1 and groups ({groups})")
    v3 = method == "noaux_tc"
    if v3 != (bias is not None):
        raise ValueError("bias (e_score_correction_bias) is needed by noaux_tc and by no other "
                         "method")
    if bias is not None and (bias.shape != (experts,) or bias.dtype != torch.float32):
        raise ValueError(f"bias must be float32 [{experts}], got {bias.dtype} "
                         f"{tuple(bias.shape)}")
    experts_total = experts if experts_total is None else experts_total
    if shared < 0 or experts_total < experts:
        raise ValueError(f"shared ({shared}) must be >= 0 and experts_total ({experts_total}) "
                         f">= the {experts} routed experts")
    tokens = x.shape[0]
    width = top_k + shared
    weights = torch.empty(tokens, width, dtype=torch.float32, device=x.device)
    ids = torch.empty(tokens, width, dtype=torch.int32, device=x.device)
    if tokens == 0:
        return weights, ids
    # The logits as the Router computes them (cuBLAS, float32): bit for bit its values. A GEMV
    # inside the kernel, one program per 16 tokens streaming the whole weight, took 87 µs per
    # layer at batch 1 on an H200 against ~5 µs for the cast and cuBLAS's GEMV.
    logits = F.linear(x.float(), weight)
    e_p2 = triton.next_power_of_2(experts)
    # V2 renormalises only with k > 1 and then does not scale; V3 always scales.
    renorm = norm and (v3 or top_k > 1)
    _router_kernel[(triton.cdiv(tokens, BLOCK_T),)](
        logits, bias if v3 else logits, weights, ids, tokens, float(scaling),
        experts_total, E=experts, E_P2=e_p2, K=top_k, SHARED=shared,
        OUT_P2=triton.next_power_of_2(width), GROUPS=groups, TOPK_GROUP=topk_group,
        G_P2=triton.next_power_of_2(groups),
        GROUPED=groups > 1 and method != "greedy", SIGMOID=v3, RENORM=renorm,
        SCALE=v3 or not renorm, BLOCK_T=BLOCK_T, **pdl_args(logits.device),
        num_warps=4 if e_p2 <= 64 else 8)
    return weights, ids
