"""Fused elementwise steps of a decoder layer: residual add + RMSNorm, and the new tokens'
RoPE: the latent rows' norm + RoPE + pool store with the query's RoPE.

A decode step moves a few kilobytes per token through each of these, so what it pays is kernel
launches, not bytes. In the torch path each step is a chain of small kernels:

* :func:`add_rms_norm` — ``residual + delta`` (or the sum of several terms, e.g. the MoE's
  per-expert outputs) then ``F.rms_norm`` (an add, and the norm's own cast / square / mean /
  rsqrt / multiply kernels, or its fused kernel): one launch that writes both the new residual
  and its normed copy.
* :func:`store_latent` — ``MLAttention.latent`` then ``PagedKV.store``: a split, kv_a_layernorm,
  the rotary's float cast, complex multiply and cast back, a ``cat``, and two ``index_copy_``
  into the pool; and the rotary on the query's q_rope columns: one launch that reads the
  kv_a_proj_with_mqa row once, writes the normed c_KV and the rotated k_r straight into their
  slots, and the rotated query columns straight into the attention kernel's query buffer (whose
  latent part the absorb bmm writes in place: no ``cat``).

Each matches its torch chain's arithmetic: statistics and rotations in float32 and one rounding
of each output to its dtype (torch's F.rms_norm rounds x·rsqrt·weight once as well; its bf16 add
adds in float32 and rounds). Nothing is read back to the host, and every output's size follows
from the inputs' shapes, so a CUDA graph captures these launches. Inputs are indexed through
their strides: views (a split of a projection, a transposed bmm output) need no copy.

The kernels take tensors and numbers only: this module imports nothing from the model. The
rotation's phasors come in as ``torch.view_as_real`` of the rotary's complex ``cis`` (float32
[T, rope/2, 2]: cos·magnitude, sin·magnitude), so YaRN's magnitude is applied exactly as
``Rotary.apply`` applies it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .interpreter import interpreted
from .launch import pdl_args, release_next, wait_for_previous
from .rotate import pair_layout

# A normed row is held whole in one program's registers (one pass: read once, write once).
# DeepSeek-V3's 7168 pads to 8192; 16 warps keep that at 16 float32 values per thread per input.
MAX_NORM_DIM = 16384


@triton.jit
def _round(x, DTYPE: tl.constexpr, BY_HAND: tl.constexpr):
    """float32 x rounded to DTYPE, to nearest even (torch's rounding). Triton's CPU interpreter
    truncates float32 → bfloat16 (the GPU rounds): ``BY_HAND`` rounds the bits first there, so
    the cast after it is exact."""
    if BY_HAND and DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000  # a carry bumps the exponent
        x = bits.to(tl.float32, bitcast=True)
    return x.to(DTYPE)


@triton.jit
def _add_rms_norm_kernel(DELTA, RESIDUAL, WEIGHT, NORMED, SUMMED, NORMED_FLOAT, dim, delta_s0,
                         delta_s1, delta_s2, residual_s0, residual_s1, eps, TERMS: tl.constexpr,
                         FLOAT: tl.constexpr, BLOCK: tl.constexpr, BY_HAND: tl.constexpr,
                         RELEASE: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    if RELEASE:
        release_next(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < dim
    dtype = SUMMED.dtype.element_ty
    d = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(TERMS):
        d += tl.load(DELTA + row * delta_s0 + j * delta_s1 + cols * delta_s2, mask=ok,
                     other=0.0).to(tl.float32)
    if TERMS > 1:  # torch sums half-precision terms in float32 and rounds the sum once
        d = _round(d, dtype, BY_HAND).to(tl.float32)
    r = tl.load(RESIDUAL + row * residual_s0 + cols * residual_s1, mask=ok,
                other=0.0).to(tl.float32)
    # torch adds half-precision tensors in float32 and rounds the sum once; the norm then sees
    # the rounded sum — the residual the next layer adds to — so its statistics do too.
    summed = _round(r + d, dtype, BY_HAND)
    tl.store(SUMMED + row * dim + cols, summed, mask=ok)
    x = summed.to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, 0) / dim + eps)  # masked lanes are 0: they add nothing
    # F.rms_norm gets weight.to(x.dtype): round the weight the same way before it multiplies.
    w = _round(tl.load(WEIGHT + cols, mask=ok, other=0.0).to(tl.float32), dtype,
               BY_HAND).to(tl.float32)
    normed = _round(x * inv * w, dtype, BY_HAND)
    tl.store(NORMED + row * dim + cols, normed, mask=ok)
    if FLOAT:  # the rounded values again, widened: what normed.float() would write
        tl.store(NORMED_FLOAT + row * dim + cols, normed.to(tl.float32), mask=ok)


@triton.jit
def _phasors(CIS, t, cis_s0, cis_s1, cis_s2, HALF: tl.constexpr, HALF_P2: tl.constexpr):
    """Pair indices [HALF_P2], their mask, and token t's cos and sin (float32) per pair."""
    pairs = tl.arange(0, HALF_P2)
    ok = pairs < HALF
    at = CIS + t * cis_s0 + pairs * cis_s1
    return pairs, ok, tl.load(at, mask=ok, other=1.0), tl.load(at + cis_s2, mask=ok, other=0.0)


@triton.jit
def _rotate_pairs(SRC, src_col, DST, dst_col, pairs, ok, cos, sin, STEP: tl.constexpr,
                  SHIFT: tl.constexpr, BY_HAND: tl.constexpr):
    """DST's pairs = SRC's pairs (a, b) rotated: (a cos − b sin, b cos + a sin) in float32, one
    rounding to DST's dtype. Pair i is (i·STEP, i·STEP + SHIFT) (``rotate.pair_layout``); SRC and
    DST are row pointers, broadcast against ``pairs`` (several rows at once: one per head)."""
    first = pairs * STEP
    second = first + SHIFT
    a = tl.load(SRC + first * src_col, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(SRC + second * src_col, mask=ok, other=0.0).to(tl.float32)
    out = DST.dtype.element_ty
    tl.store(DST + first * dst_col, _round(a * cos - b * sin, out, BY_HAND), mask=ok)
    tl.store(DST + second * dst_col, _round(b * cos + a * sin, out, BY_HAND), mask=ok)


@triton.jit
def _absorb_tile(Q_NOPE, W_UK, ABSORBED, tile, tokens, qn_s0, qn_s1, qn_s2, wk_s0, wk_s1,
                 wk_s2, ab_s0, ab_s1, ab_s2, heads, NOPE: tl.constexpr, RANK: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_P: tl.constexpr,
                 UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """One tile of q̃ = W_UKᵀ q_nope: BLOCK_T tokens × BLOCK_L latent columns of one head,
    accumulated in float32 and rounded once (torch.bmm's arithmetic, in another order)."""
    per_head = tl.cdiv(RANK, BLOCK_L)
    t_block = tile // (heads * per_head)
    h = ((tile // per_head) % heads).to(tl.int64)
    cols = (tile % per_head) * BLOCK_L + tl.arange(0, BLOCK_L)
    col_ok = cols < RANK
    rows = t_block * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < tokens
    ps = tl.arange(0, BLOCK_P)
    acc = tl.zeros([BLOCK_T, BLOCK_L], tl.float32)
    for p0 in range(0, NOPE, BLOCK_P):
        p_ok = p0 + ps < NOPE
        q = tl.load(Q_NOPE + rows[:, None].to(tl.int64) * qn_s0 + h * qn_s1
                    + (p0 + ps)[None, :] * qn_s2, mask=row_ok[:, None] & p_ok[None, :], other=0.0)
        w = tl.load(W_UK + h * wk_s0 + (p0 + ps)[:, None] * wk_s1 + cols[None, :] * wk_s2,
                    mask=p_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST:  # the interpreter multiplies bf16 tiles wrongly: float32 there
            q, w = q.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(q, w, acc, input_precision=PRECISION)
    tl.store(ABSORBED + rows[:, None].to(tl.int64) * ab_s0 + h * ab_s1 + cols[None, :] * ab_s2,
             acc.to(ABSORBED.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["tokens"])
def _store_latent_kernel(KV_A, WEIGHT, CIS, CKV, KR, CKV_SLOTS, KR_SLOTS, Q_ROPE, Q_OUT,
                         q_s0, q_s1, q_s2, out_s0, out_s1, out_s2, heads,
                         kv_s0, kv_s1, cis_s0, cis_s1, cis_s2, ckv_s0, ckv_s1, kr_s0, kr_s1, eps,
                         Q_NOPE, W_UK, ABSORBED, tokens, qn_s0, qn_s1, qn_s2, wk_s0, wk_s1, wk_s2,
                         ab_s0, ab_s1, ab_s2,
                         RANK: tl.constexpr, RANK_P2: tl.constexpr, HALF: tl.constexpr,
                         HALF_P2: tl.constexpr, STEP: tl.constexpr, SHIFT: tl.constexpr,
                         QUERY: tl.constexpr, HEADS_P2: tl.constexpr, BY_HAND: tl.constexpr,
                         ABSORB: tl.constexpr, NOPE: tl.constexpr, ABS_RANK: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_P: tl.constexpr,
                         UPCAST: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    if ABSORB:  # programs past the tokens' each absorb one tile of the query
        if t >= tokens:
            _absorb_tile(Q_NOPE, W_UK, ABSORBED, t - tokens, tokens, qn_s0, qn_s1, qn_s2, wk_s0,
                         wk_s1, wk_s2, ab_s0, ab_s1, ab_s2, heads, NOPE, ABS_RANK, BLOCK_T,
                         BLOCK_L, BLOCK_P, UPCAST, PRECISION)
            return
    row = KV_A + t * kv_s0
    # c_KV: RMSNorm of the first RANK columns, written to this token's c_KV slot.
    cols = tl.arange(0, RANK_P2)
    ok = cols < RANK
    c = tl.load(row + cols * kv_s1, mask=ok, other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(c * c, 0) / RANK + eps)
    # RMSNorm multiplies by weight.to(x.dtype): the weight rounds to kv_a's dtype first.
    w = _round(tl.load(WEIGHT + cols, mask=ok, other=0.0).to(tl.float32), KV_A.dtype.element_ty,
               BY_HAND).to(tl.float32)
    ckv_slot = tl.load(CKV_SLOTS + t).to(tl.int64)
    tl.store(CKV + ckv_slot * ckv_s0 + cols * ckv_s1,
             _round(c * inv * w, CKV.dtype.element_ty, BY_HAND), mask=ok)
    # k_r: the remaining columns rotated to the token's position, written to its k_r slot.
    pairs, pair_ok, cos, sin = _phasors(CIS, t, cis_s0, cis_s1, cis_s2, HALF, HALF_P2)
    kr_slot = tl.load(KR_SLOTS + t).to(tl.int64)
    _rotate_pairs(row + RANK * kv_s1, kv_s1, KR + kr_slot * kr_s0, kr_s1, pairs, pair_ok, cos,
                  sin, STEP, SHIFT, BY_HAND)
    if QUERY:  # every head's query rope columns, by the same phasors
        h = tl.arange(0, HEADS_P2).to(tl.int64)[:, None]
        _rotate_pairs(Q_ROPE + t * q_s0 + h * q_s1, q_s2, Q_OUT + t * out_s0 + h * out_s1, out_s2,
                      pairs[None, :], (h < heads) & pair_ok[None, :], cos[None, :],
                      sin[None, :], STEP, SHIFT, BY_HAND)


def _check_devices(*tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"tensors on several devices: {sorted(map(str, devices))}")


def _check_cis(cis: torch.Tensor, tokens: int, rope: int) -> None:
    """``cis`` must be view_as_real of a complex [T, rope/2]: float32 [T, rope/2, 2]."""
    if rope % 2:
        raise ValueError(f"rope dim {rope} is odd: rotation pairs need an even dim")
    if cis.dtype != torch.float32 or tuple(cis.shape) != (tokens, rope // 2, 2):
        raise ValueError(f"cis is {cis.dtype} {tuple(cis.shape)}, want torch.float32 "
                         f"{(tokens, rope // 2, 2)} (torch.view_as_real of the complex phasors)")


def add_rms_norm(delta: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float, normed_float: torch.Tensor | None = None, *,
                 release: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, summed): ``summed = residual + delta`` rounded to their dtype, and ``normed =
    F.rms_norm(summed, (D,), weight.to(summed.dtype), eps)`` — statistics in float32 over the
    rounded sum, times the weight, rounded once. Both new contiguous [T, D] tensors.

    ``delta``: [T, D], or [T, J, D] terms added as ``delta.sum(1)`` (float32, rounded once to
    the dtype: torch's sum of a half-precision tensor) — the routed experts' per-assignment
    outputs, summed here rather than by a launch of their own. ``residual``: [T, D] of the same
    floating dtype; both any strides. ``weight``: [D], any floating dtype. D up to
    :data:`MAX_NORM_DIM`. ``normed_float``: a contiguous float32 [T, D] that also receives
    ``normed.float()`` (the MoE router's input, which reads in float32: no cast launch).
    ``release``: let the next launch start once this one's programs have waited, for a next
    launch that reads its weights before its own wait (:mod:`.gemv`)."""
    if delta.dim() not in (2, 3) or (delta.shape[0], delta.shape[-1]) != residual.shape \
            or residual.dim() != 2:
        raise ValueError(f"delta {tuple(delta.shape)} must be [T, D] or [T, J, D] and residual "
                         f"{tuple(residual.shape)} [T, D] of the same T and D")
    tokens, dim = residual.shape
    if delta.dtype != residual.dtype or not residual.dtype.is_floating_point:
        raise ValueError(f"delta ({delta.dtype}) and residual ({residual.dtype}) must share a "
                         f"floating dtype")
    if tuple(weight.shape) != (dim,) or not weight.dtype.is_floating_point:
        raise ValueError(f"weight is {weight.dtype} {tuple(weight.shape)}, want a floating [{dim}]")
    if not 0 < dim <= MAX_NORM_DIM:
        raise ValueError(f"hidden size {dim} outside 1..{MAX_NORM_DIM} (one row per program)")
    _check_devices(delta, residual, weight)
    if normed_float is not None and (normed_float.dtype != torch.float32
                                     or normed_float.shape != residual.shape
                                     or not normed_float.is_contiguous()):
        raise ValueError(f"normed_float is {normed_float.dtype} {tuple(normed_float.shape)}, "
                         f"want a contiguous torch.float32 {tuple(residual.shape)}")
    if normed_float is not None:
        _check_devices(residual, normed_float)
    # Not empty_like: that would copy a transposed input's layout; the kernel writes rows.
    normed, summed = (torch.empty(tokens, dim, dtype=residual.dtype, device=residual.device)
                      for _ in range(2))
    if tokens == 0:
        return normed, summed
    terms = delta if delta.dim() == 3 else delta[:, None]
    block = triton.next_power_of_2(dim)
    _add_rms_norm_kernel[(tokens,)](
        terms, residual, weight.contiguous(), normed, summed,
        normed if normed_float is None else normed_float, dim, *terms.stride(),
        *residual.stride(), eps, TERMS=terms.shape[1], FLOAT=normed_float is not None,
        BLOCK=block, BY_HAND=interpreted(), RELEASE=release, **pdl_args(residual.device),
        num_warps=16 if block >= 8192 else 8 if block >= 2048 else 4)
    return normed, summed


def store_latent(kv_a: torch.Tensor, norm_weight: torch.Tensor, eps: float, cis: torch.Tensor,
                 interleaved: bool, ckv: torch.Tensor, kr: torch.Tensor, ckv_slots: torch.Tensor,
                 kr_slots: torch.Tensor, q_rope: torch.Tensor | None = None,
                 q_out: torch.Tensor | None = None, q_nope: torch.Tensor | None = None,
                 w_uk: torch.Tensor | None = None, absorbed: torch.Tensor | None = None) -> None:
    """Store the new tokens' latent rows in one layer of the pool: ``ckv[ckv_slots[t]] =
    rms_norm(kv_a[t, :rank]) · norm_weight`` and ``kr[kr_slots[t]] = kv_a[t, rank:]`` rotated
    by ``cis[t]`` — ``MLAttention.latent`` followed by ``PagedKV.store``.

    ``kv_a`` [T, rank + rope]: kv_a_proj_with_mqa's output (any strides); ``norm_weight``
    [rank]: kv_a_layernorm's weight (rounded to kv_a's dtype first, as RMSNorm does); ``cis``
    float32 [T, rope/2, 2]: ``torch.view_as_real`` of the rotary's phasors at the tokens'
    positions, magnitude included; ``interleaved``: rotation pairs (2i, 2i+1), else (i, i +
    rope/2). ``ckv`` [slots, rank] and ``kr`` [kr_slots, rope]: one layer's pool (any strides);
    ``ckv_slots`` / ``kr_slots``: integer [T], each token's slot (not range-checked: that
    would read them on the host). The norm and the rotation compute in float32 and round once
    to the pool's dtype — the torch path's roundings when the pool has kv_a's dtype, as the
    engine's does (with another dtype the torch path rounds twice).

    ``q_rope`` [T, H, rope] and ``q_out`` [T, H, rope] (any strides, e.g. the rope columns of
    the q projection and of the attention kernel's query buffer): also ``q_out = q_rope``
    rotated by ``cis`` — ``Rotary.apply`` on the query — in the same launch, as the tokens'
    phasors are already loaded; in float32, rounded once to q_out's dtype.

    ``q_nope`` [T, H, P], ``w_uk`` [H, P, L] and ``absorbed`` [T, H, L] (any strides, e.g. the
    nope columns of the q projection, W_UK's rows of kv_b_proj and the latent columns of the
    attention kernel's query buffer): also the absorbed query ``absorbed[t, h] = q_nope[t, h] @
    w_uk[h]`` — ``MLAttention._absorb``, a bmm of its own before — by more programs of the same
    launch, in float32 tiles rounded once to absorbed's dtype."""
    if kv_a.dim() != 2 or ckv.dim() != 2 or kr.dim() != 2:
        raise ValueError(f"kv_a {tuple(kv_a.shape)}, ckv {tuple(ckv.shape)} and kr "
                         f"{tuple(kr.shape)} must be 2-D (one layer's pool slices)")
    tokens = kv_a.shape[0]
    rank, rope = ckv.shape[1], kr.shape[1]
    if kv_a.shape[1] != rank + rope:
        raise ValueError(f"kv_a rows of {kv_a.shape[1]} columns, want rank {rank} + rope {rope}")
    if tuple(norm_weight.shape) != (rank,):
        raise ValueError(f"norm_weight {tuple(norm_weight.shape)}, want ({rank},)")
    for name, t in (("kv_a", kv_a), ("norm_weight", norm_weight), ("ckv", ckv), ("kr", kr)):
        if not t.dtype.is_floating_point:
            raise ValueError(f"{name} is {t.dtype}, want a floating dtype")
    for name, slots in (("ckv_slots", ckv_slots), ("kr_slots", kr_slots)):
        if slots.dtype not in (torch.int32, torch.int64) or tuple(slots.shape) != (tokens,):
            raise ValueError(f"{name} is {slots.dtype} {tuple(slots.shape)}, want int64 (or "
                             f"int32) ({tokens},)")
    _check_cis(cis, tokens, rope)
    _check_devices(kv_a, norm_weight, cis, ckv, kr, ckv_slots, kr_slots)
    if (q_rope is None) != (q_out is None):
        raise ValueError("q_rope and q_out go together: pass both or neither")
    # Without a query the kernel skips that part (QUERY off): kv_a stands in for its pointers.
    heads, query_args = 0, (kv_a, kv_a, *(0,) * 6)
    if q_rope is not None and q_out is not None:
        if q_rope.dim() != 3 or q_rope.shape != q_out.shape or q_rope.shape[::2] != (tokens, rope):
            raise ValueError(f"q_rope {tuple(q_rope.shape)} and q_out {tuple(q_out.shape)} must "
                             f"both be [T={tokens}, H, rope={rope}]")
        if not (q_rope.dtype.is_floating_point and q_out.dtype.is_floating_point):
            raise ValueError(f"q_rope ({q_rope.dtype}) and q_out ({q_out.dtype}) must be "
                             "floating point")
        _check_devices(kv_a, q_rope, q_out)
        heads, query_args = q_rope.shape[1], (q_rope, q_out, *q_rope.stride(), *q_out.stride())
    absorb_args, absorb_meta, tiles = _absorb_args(tokens, kv_a, q_nope, w_uk, absorbed)
    if tokens == 0:
        return
    step, shift = pair_layout(rope, interleaved)
    _store_latent_kernel[(tokens + tiles,)](
        kv_a, norm_weight.contiguous(), cis, ckv, kr, ckv_slots.contiguous(),
        kr_slots.contiguous(), *query_args, heads, *kv_a.stride(), *cis.stride(),
        *ckv.stride(), *kr.stride(), eps, *absorb_args,
        RANK=rank, RANK_P2=triton.next_power_of_2(rank), HALF=rope // 2,
        HALF_P2=triton.next_power_of_2(rope // 2), STEP=step, SHIFT=shift, QUERY=heads > 0,
        HEADS_P2=triton.next_power_of_2(max(heads, 1)), BY_HAND=interpreted(),
        **absorb_meta, **pdl_args(kv_a.device),
        num_warps=4 if rank <= 1024 else 8)


# The absorb's tiles: 16 tokens (tl.dot's least) × 128 latent columns of a head, 64 of the
# P nope columns a step (V2's 16 heads × 512 columns: 64 tiles per 16 tokens).
ABSORB_TOKENS, ABSORB_COLUMNS, ABSORB_STEP = 16, 128, 64


def _absorb_args(tokens: int, kv_a: torch.Tensor, q_nope: torch.Tensor | None,
                 w_uk: torch.Tensor | None, absorbed: torch.Tensor | None
                 ) -> tuple[tuple, dict, int]:
    """store_latent's absorb arguments (checked), its constexprs and its tile count; without
    one, placeholders the kernel never reads and no tiles."""
    given = [t is not None for t in (q_nope, w_uk, absorbed)]
    meta = dict(ABSORB=False, NOPE=16, ABS_RANK=16, BLOCK_T=16, BLOCK_L=16, BLOCK_P=16,
                UPCAST=False, PRECISION="ieee")
    if not any(given):
        return (kv_a, kv_a, kv_a, tokens, *(0,) * 9), meta, 0
    if not all(given):
        raise ValueError("q_nope, w_uk and absorbed go together: pass all three or none")
    assert q_nope is not None and w_uk is not None and absorbed is not None
    if q_nope.dim() != 3 or w_uk.dim() != 3 or absorbed.dim() != 3:
        raise ValueError(f"q_nope {tuple(q_nope.shape)}, w_uk {tuple(w_uk.shape)} and absorbed "
                         f"{tuple(absorbed.shape)} must be [T, H, P], [H, P, L] and [T, H, L]")
    heads, nope, rank = w_uk.shape
    if q_nope.shape != (tokens, heads, nope) or absorbed.shape != (tokens, heads, rank):
        raise ValueError(f"q_nope {tuple(q_nope.shape)} and absorbed {tuple(absorbed.shape)} "
                         f"do not fit w_uk {tuple(w_uk.shape)} over {tokens} tokens: want "
                         f"[{tokens}, {heads}, {nope}] and [{tokens}, {heads}, {rank}]")
    if not (q_nope.dtype == w_uk.dtype == absorbed.dtype and q_nope.dtype.is_floating_point):
        raise ValueError(f"q_nope ({q_nope.dtype}), w_uk ({w_uk.dtype}) and absorbed "
                         f"({absorbed.dtype}) must share a floating dtype")
    _check_devices(kv_a, q_nope, w_uk, absorbed)
    upcast = interpreted() and q_nope.dtype != torch.float32
    meta = dict(ABSORB=True, NOPE=nope, ABS_RANK=rank, BLOCK_T=ABSORB_TOKENS,
                BLOCK_L=min(ABSORB_COLUMNS, triton.next_power_of_2(rank)),
                BLOCK_P=min(ABSORB_STEP, max(16, triton.next_power_of_2(nope))), UPCAST=upcast,
                PRECISION="ieee" if q_nope.dtype == torch.float32 or upcast else "tf32")
    tiles = (triton.cdiv(tokens, ABSORB_TOKENS) * heads
             * triton.cdiv(rank, meta["BLOCK_L"]))
    return ((q_nope, w_uk, absorbed, tokens, *q_nope.stride(), *w_uk.stride(),
             *absorbed.stride()), meta, tiles)
