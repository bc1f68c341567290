"""Fused MoE router: scoring, group limiting, top-k and the weights' normalisation of
DeepSeek-V2/V3 routers in one Triton launch — after cuBLAS's logits (:func:`route`), or, for a
decode step, with the logits and the fused MoE's block sort in the same launch
(:func:`route_aligned`).

Decode is launch-bound. On an H200 a DeepSeek-V2-Lite decode step ran
:class:`~irminsul.model.moe.Router` as about eight small kernels per MoE layer (cast, GEMV,
softmax, topk as a gather and a bitonic sort, scale), ~17 µs per layer at batch 1. In
:func:`route` the logits are the Router's own (x.float() · weightᵀ, cuBLAS in float32, bit for
bit its values) and one program per block of tokens does the rest in registers; in
:func:`route_aligned` programs each compute a few experts' logits for every token, and the last
of them to finish (an atomic count of finished programs) does the rest and sorts the
assignments into blocks (:func:`~irminsul.kernels.fused_moe.align_blocks`' arithmetic):

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

import functools
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .fused_moe import Alignment, AlignShape, _align_chunk
from .launch import pdl_args, release_next, wait_for_previous

METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
# Tokens per program: one block covers decode batches up to 16, larger ones get more programs.
BLOCK_T = 16
# route_aligned's one-launch path: up to this many tokens (a decode step's), its GEMV spread
# over about this many programs.
ALIGNED_MAX_TOKENS = 16
GEMV_PROGRAMS = 32
# route_aligned sorts the shared experts' blocks first and lets the fused MoE launch while it
# routes, its shared-expert programs running beside the routing (Alignment.lead). A switch for
# benchmarks' A/B; the sort is the same either way but for the order of the experts' runs.
SHARED_FIRST = True


@triton.jit
def _choose(logits, BIAS, rows, row_ok, scaling, experts_total,
            E: tl.constexpr, E_P2: tl.constexpr, K: tl.constexpr, SHARED: tl.constexpr,
            OUT_P2: tl.constexpr, GROUPS: tl.constexpr, TOPK_GROUP: tl.constexpr,
            G_P2: tl.constexpr, GROUPED: tl.constexpr, SIGMOID: tl.constexpr,
            RENORM: tl.constexpr, SCALE: tl.constexpr, BLOCK_T: tl.constexpr):
    """Steps 2-5 of the module's docstring on logits [BLOCK_T, E_P2] (padding columns any
    value): the weights float32 and ids int32 [BLOCK_T, OUT_P2], shared columns included."""
    experts = tl.arange(0, E_P2)
    expert_ok = experts < E

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
    return out_w, out_id


@triton.jit
def _store_choice(WEIGHTS, IDS, out_w, out_id, rows, row_ok, K: tl.constexpr,
                  SHARED: tl.constexpr, OUT_P2: tl.constexpr):
    cols = tl.arange(0, OUT_P2)
    at = rows[:, None].to(tl.int64) * (K + SHARED) + cols[None, :]
    ok = row_ok[:, None] & (cols < K + SHARED)[None, :]
    tl.store(WEIGHTS + at, out_w, mask=ok)
    tl.store(IDS + at, out_id, mask=ok)


@triton.jit(do_not_specialize=["tokens"])
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
    # 1. logits [BLOCK_T, E_P2], computed before the launch.
    logits = tl.load(LOGITS + rows[:, None].to(tl.int64) * E + experts[None, :],
                     mask=row_ok[:, None] & (experts < E)[None, :], other=0.0)
    out_w, out_id = _choose(logits, BIAS, rows, row_ok, scaling, experts_total, E, E_P2, K,
                            SHARED, OUT_P2, GROUPS, TOPK_GROUP, G_P2, GROUPED, SIGMOID, RENORM,
                            SCALE, BLOCK_T)
    _store_choice(WEIGHTS, IDS, out_w, out_id, rows, row_ok, K, SHARED, OUT_P2)


@triton.jit(do_not_specialize=["tokens", "blocks"])
def _route_aligned_kernel(X, W, LOGITS, COUNTER, BIAS, WEIGHTS, IDS, SORTED, BLOCK_EXPERT, USED,
                          tokens, dim, x_s0, scaling, experts_total, blocks,
                          E: tl.constexpr, E_P2: tl.constexpr, K: tl.constexpr,
                          SHARED: tl.constexpr, OUT_P2: tl.constexpr, GROUPS: tl.constexpr,
                          TOPK_GROUP: tl.constexpr, G_P2: tl.constexpr, GROUPED: tl.constexpr,
                          SIGMOID: tl.constexpr, RENORM: tl.constexpr, SCALE: tl.constexpr,
                          BLOCK_T: tl.constexpr, PER_PROGRAM: tl.constexpr,
                          BLOCK_D: tl.constexpr, BINS_P2: tl.constexpr, BLOCK_M: tl.constexpr,
                          CHUNK: tl.constexpr, SCAN: tl.constexpr, BLOCK_CHUNK: tl.constexpr,
                          LEAD: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    if LEAD > 0:  # the fused MoE's shared-expert programs need only x: let them start now
        release_next(PDL)
    # 1. Each program: the logits of PER_PROGRAM experts for every token (float32 products of
    # the widened x and the float32 weight, as the Router's F.linear).
    rows = tl.arange(0, BLOCK_T)
    row_ok = rows < tokens
    mine = tl.program_id(0) * PER_PROGRAM + tl.arange(0, PER_PROGRAM)
    mine_ok = mine < E
    acc = tl.zeros([BLOCK_T, PER_PROGRAM], tl.float32)
    for d0 in range(0, dim, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        d_ok = d < dim
        x = tl.load(X + rows[:, None].to(tl.int64) * x_s0 + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        w = tl.load(W + mine[:, None].to(tl.int64) * dim + d[None, :],
                    mask=mine_ok[:, None] & d_ok[None, :], other=0.0)
        acc += tl.sum(x[:, None, :] * w[None, :, :], 2)
    tl.store(LOGITS + rows[:, None] * E + mine[None, :], acc,
             mask=row_ok[:, None] & mine_ok[None, :])
    # The last program to finish does the rest: every thread's logits stored (the barrier),
    # then one release/acquire count; the others are done.
    tl.debug_barrier()
    done = tl.atomic_add(COUNTER, 1, sem="acq_rel", scope="gpu")
    if done == tl.num_programs(0) - 1:
        experts = tl.arange(0, E_P2)
        logits = tl.load(LOGITS + rows[:, None] * E + experts[None, :],
                         mask=row_ok[:, None] & (experts < E)[None, :], other=0.0,
                         volatile=True)  # past L1: written by other programs
        out_w, out_id = _choose(logits, BIAS, rows, row_ok, scaling, experts_total, E, E_P2, K,
                                SHARED, OUT_P2, GROUPS, TOPK_GROUP, G_P2, GROUPED, SIGMOID,
                                RENORM, SCALE, BLOCK_T)
        _store_choice(WEIGHTS, IDS, out_w, out_id, rows, row_ok, K, SHARED, OUT_P2)
        tl.debug_barrier()  # the ids stored, read back flat by every thread of this program
        n = tokens * (K + SHARED)
        for first in range(0, n, CHUNK):
            _align_chunk(IDS, SORTED, BLOCK_EXPERT, USED, n, blocks, first,
                         experts_total + SHARED, BINS_P2, BLOCK_M, CHUNK, SCAN, BLOCK_CHUNK,
                         True, LEAD)
        tl.atomic_xchg(COUNTER, 0)  # ready for the next launch


def _check(x: torch.Tensor, weight: torch.Tensor, top_k: int, method: str, groups: int,
           topk_group: int, bias: torch.Tensor | None, shared: int,
           experts_total: int | None) -> int:
    """Raise on arguments :func:`route` cannot take; the experts_total to use."""
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
    return experts_total


def _choice_meta(experts: int, top_k: int, method: str, groups: int, topk_group: int,
                 norm: bool, shared: int) -> dict[str, Any]:
    """The constexprs of :func:`_choose`."""
    v3 = method == "noaux_tc"
    # V2 renormalises only with k > 1 and then does not scale; V3 always scales.
    renorm = norm and (v3 or top_k > 1)
    return dict(E=experts, E_P2=triton.next_power_of_2(experts), K=top_k, SHARED=shared,
                OUT_P2=triton.next_power_of_2(top_k + shared), GROUPS=groups,
                TOPK_GROUP=topk_group, G_P2=triton.next_power_of_2(groups),
                GROUPED=groups > 1 and method != "greedy", SIGMOID=v3, RENORM=renorm,
                SCALE=v3 or not renorm)


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
    experts_total = _check(x, weight, top_k, method, groups, topk_group, bias, shared,
                           experts_total)
    tokens, width = x.shape[0], top_k + shared
    weights = torch.empty(tokens, width, dtype=torch.float32, device=x.device)
    ids = torch.empty(tokens, width, dtype=torch.int32, device=x.device)
    if tokens == 0:
        return weights, ids
    # The logits as the Router computes them (cuBLAS, float32): bit for bit its values.
    logits = F.linear(x.float(), weight)
    meta = _choice_meta(weight.shape[0], top_k, method, groups, topk_group, norm, shared)
    _router_kernel[(triton.cdiv(tokens, BLOCK_T),)](
        logits, logits if bias is None else bias, weights, ids, tokens, float(scaling),
        experts_total, BLOCK_T=BLOCK_T, **meta, **pdl_args(logits.device),
        num_warps=4 if meta["E_P2"] <= 64 else 8)
    return weights, ids


@functools.cache
def _counter(device: torch.device) -> torch.Tensor:
    """The programs-done count of :func:`route_aligned`'s launches on ``device``: zero between
    launches (the last program resets it). Launches on one device run one at a time (one
    stream: the engine's), so one count serves them all."""
    return torch.zeros(1, dtype=torch.int32, device=device)


def route_aligned(x: torch.Tensor, weight: torch.Tensor, *, top_k: int, method: str,
                  groups: int, topk_group: int, norm: bool, scaling: float, block_m: int,
                  bias: torch.Tensor | None = None, shared: int = 0,
                  experts_total: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, Alignment]:
    """:func:`route`, and its assignments sorted by expert into blocks of ``block_m`` rows for
    the fused MoE (``align_blocks(ids, experts_total + shared, block_m)``).

    Up to :data:`ALIGNED_MAX_TOKENS` tokens (a decode step) this is one launch where it was
    four (cuBLAS's GEMV and its reduction, the router, the sort): programs each compute some
    experts' logits for every token, and the last one to finish (an atomic count) chooses the
    experts and sorts the assignments. Above that, :func:`route` then the sort. The logits
    there are the same products summed in another order than cuBLAS's, so weights match the
    Router's to float32 rounding, and ids wherever two experts' logits are not within it.
    On that path the ``shared`` experts' runs are sorted first (the :class:`Alignment`'s
    ``lead``, while :data:`SHARED_FIRST`) and the launch releases the next one (the fused MoE)
    as soon as it starts: the shared experts' gate/up programs, whose rows that order fixes,
    stream their weights while this launch still routes."""
    from .fused_moe import align_blocks

    experts_total = _check(x, weight, top_k, method, groups, topk_group, bias, shared,
                           experts_total)
    tokens, (experts, dim) = x.shape[0], weight.shape
    bins = experts_total + shared
    if tokens == 0 or tokens > ALIGNED_MAX_TOKENS or x.stride(1) != 1:
        weights, ids = route(x, weight, top_k=top_k, method=method, groups=groups,
                             topk_group=topk_group, norm=norm, scaling=scaling, bias=bias,
                             shared=shared, experts_total=experts_total)
        return weights, ids, align_blocks(ids, bins, block_m)
    width = top_k + shared
    weights = torch.empty(tokens, width, dtype=torch.float32, device=x.device)
    ids = torch.empty(tokens, width, dtype=torch.int32, device=x.device)
    logits = torch.empty(tokens, experts, dtype=torch.float32, device=x.device)
    shape = AlignShape.of(tokens * width, bins, block_m)
    lead = shared if SHARED_FIRST else 0
    out = shape.empty(x.device, block_m, bins, lead)
    meta = _choice_meta(experts, top_k, method, groups, topk_group, norm, shared)
    block_t = triton.next_power_of_2(tokens)
    # Programs of 2+ experts each, about GEMV_PROGRAMS of them; the [tokens, experts, D-step]
    # products within 8K lanes.
    per_program = max(2, triton.next_power_of_2(triton.cdiv(experts, GEMV_PROGRAMS)))
    block_d = min(triton.next_power_of_2(dim), max(16, 8192 // (block_t * per_program)))
    _route_aligned_kernel[(triton.cdiv(experts, per_program),)](
        x, weight, logits, _counter(x.device), logits if bias is None else bias, weights, ids,
        out.rows, out.block_expert, out.used, tokens, dim, x.stride(0), float(scaling),
        experts_total, shape.blocks, BLOCK_T=block_t, PER_PROGRAM=per_program, BLOCK_D=block_d,
        BINS_P2=shape.e_p2, BLOCK_M=block_m, CHUNK=shape.chunk, SCAN=shape.scan,
        BLOCK_CHUNK=shape.block_chunk, LEAD=lead, **meta, **pdl_args(x.device),
        num_warps=4 if meta["E_P2"] <= 64 else 8)
    return weights, ids, out
