"""Fused MoE for the routed experts: token–expert assignments sorted into per-expert blocks, then
two grouped GEMMs that read their A rows in place.

Three steps, all on the device with no host synchronisation (a CUDA graph captures them):

1. :func:`align_blocks` sorts the T·k assignments by expert into blocks of ``block_m`` rows, each
   expert's run padded to whole blocks with a sentinel (T·k), and gives every block its expert
   (-1 past the last used block) and the number of used rows. Outputs have fixed sizes, sized
   for the worst case (T·k + min(E, T·k)·(block_m − 1) rows), so the grid never depends on the
   routing. At decode sizes the router's launch does this sort itself
   (:func:`~irminsul.kernels.router.route_aligned`, the same :func:`_align_chunk`) and hands
   :func:`fused_experts` its :class:`Alignment`.
2. gate/up: one program takes a block of assignments and ``block_n`` columns of the expert's
   intermediate width, reads each assignment's token row of x in place (row = assignment // k,
   no gathered copy), computes the gate and the up tile of the same columns and writes
   silu(gate) · up, one row per assignment. Blocks of shared experts sorted first
   (:class:`Alignment`'s ``lead``) start before the sort is done.
3. down: the intermediate rows times the expert's down projection, scaled by the routing weight,
   one row per assignment in the output dtype; a sum over k gives each token's output.

Accumulation is float32 throughout. Programs past the used blocks return at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .fp8 import dequantize_tile
from .interpreter import interpreted
from .launch import pdl_args, release_next, wait_for_previous

# Up to this many assignments (T·k) the Triton kernel sorts them (each program a chunk of them,
# every program counting all of them: one launch where a decode step's torch sort would be ten
# small kernels). Above it the sort runs as torch ops (argsort, cumsum, searchsorted), whose
# fixed costs are small next to a prefill's GEMMs and which scale where the kernel's repeated
# counting would not.
ALIGN_KERNEL_MAX = 2048
ALIGN_CHUNK = 64  # assignments per program of the sort


@triton.jit
def _sort_key(e, bins, LEAD: tl.constexpr):
    """The bin an expert id sorts as: its own, or with ``LEAD`` > 0 the last ``LEAD`` of the
    ``bins`` (the shared experts) first, then the others; ids past the bins stay past them."""
    if LEAD > 0:
        return tl.where(e < bins - LEAD, e + LEAD, tl.where(e < bins, e - (bins - LEAD), e))
    return e


@triton.jit
def _align_chunk(IDS, SORTED, BLOCK_EXPERT, USED, n, blocks, first, bins,
                 E_P2: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
                 SCAN: tl.constexpr, BLOCK_CHUNK: tl.constexpr, VOLATILE: tl.constexpr,
                 LEAD: tl.constexpr):
    """Place the assignments ``first .. first + CHUNK`` in their sorted rows; the chunk at 0
    also writes the used rows, the padding and every block's expert. ``VOLATILE``: read the ids
    past the L1 cache (a caller that wrote them in the same launch). ``LEAD``: the last that
    many of the ``bins`` experts sort first (:class:`Alignment`'s ``lead``)."""
    # Every chunk counts all the assignments (and those before it) rather than waiting on the
    # others: at decode sizes that repeated count is cheaper than a second launch, and programs
    # run side by side where one program's sequential scan over every chunk took ~20 µs at
    # 64 tokens × 6 experts on an H200.
    experts = tl.arange(0, E_P2)
    counts = tl.zeros([E_P2], tl.int32)
    before = tl.zeros([E_P2], tl.int32)  # per expert, assignments before this chunk
    for start in range(0, n, SCAN):
        at = start + tl.arange(0, SCAN)
        e = tl.load(IDS + at, mask=at < n, other=E_P2, volatile=VOLATILE)  # masked: no expert
        e = _sort_key(e, bins, LEAD)
        hit = (e[:, None] == experts[None, :]).to(tl.int32)
        counts += tl.sum(hit, 0)
        before += tl.sum(hit * (at < first)[:, None].to(tl.int32), 0)
    padded = tl.cdiv(counts, BLOCK_M) * BLOCK_M
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    used = tl.sum(padded, 0)
    if first == 0:
        tl.store(USED, used)
        # Each expert's padding rows hold the sentinel n. They never overlap the assignments'
        # rows, so no ordering between these stores and the other chunks' is needed.
        j = tl.arange(0, BLOCK_M)
        tl.store(SORTED + (starts + counts)[:, None] + j[None, :], n,
                 mask=j[None, :] < (padded - counts)[:, None])
        # The expert of each block: the number of experts whose run ends at or before its
        # first row (empty experts before it count, empty ones after it end later). -1 past
        # the used rows.
        for b0 in range(0, blocks, BLOCK_CHUNK):
            b = b0 + tl.arange(0, BLOCK_CHUNK)
            row = b * BLOCK_M
            owner = tl.sum((ends[None, :] <= row[:, None]).to(tl.int32), 1)
            if LEAD > 0:  # the bin back to its expert
                owner = tl.where(owner < LEAD, owner + (bins - LEAD), owner - LEAD)
            tl.store(BLOCK_EXPERT + b, tl.where(row < used, owner, -1), mask=b < blocks)
    # This chunk's rows: its expert's start + that expert's assignments before the chunk + those
    # before it within the chunk (a stable sort: within an expert, assignment order).
    i = tl.arange(0, CHUNK)
    at = first + i
    e = _sort_key(tl.load(IDS + at, mask=at < n, other=E_P2, volatile=VOLATILE), bins, LEAD)
    earlier = (e[:, None] == e[None, :]) & (i[None, :] < i[:, None])
    rank = tl.sum(earlier.to(tl.int32), 1)
    hit = (e[:, None] == experts[None, :]).to(tl.int32)
    base = tl.sum(hit * (starts + before)[None, :], 1)
    tl.store(SORTED + base + rank, at, mask=at < n)


@triton.jit(do_not_specialize=["n", "blocks"])
def _align_kernel(IDS, SORTED, BLOCK_EXPERT, USED, n, blocks,
                  E_P2: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
                  SCAN: tl.constexpr, BLOCK_CHUNK: tl.constexpr,
                  PDL: tl.constexpr):
    wait_for_previous(PDL)
    _align_chunk(IDS, SORTED, BLOCK_EXPERT, USED, n, blocks, tl.program_id(0) * CHUNK, 0,
                 E_P2, BLOCK_M, CHUNK, SCAN, BLOCK_CHUNK, False, 0)


@triton.jit(do_not_specialize=["n", "tokens"])
def _gate_up_kernel(X, W13, H, SORTED, BLOCK_EXPERT, USED, n, tokens, topk, dim, inter,
                    x_stride, w_stride_e, w_stride_n, h_stride,
                    SG, SU, sg_stride, su_stride, routed, HAS_SHARED: tl.constexpr,
                    LEAD: tl.constexpr,
                    S13, s_stride_e, s_stride_n, up_row0, FP8: tl.constexpr, BR: tl.constexpr,
                    BC: tl.constexpr, SCALE_VEC: tl.constexpr, others,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    EVEN_K: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                    PDL: tl.constexpr):
    if LEAD > 0:  # blocks on the slow axis: the leading ones' programs are launched first
        pid_m, pid_n = tl.program_id(1), tl.program_id(0)
    else:
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    # With LEAD shared experts sorted first, their blocks' rows are known without the sort
    # (expert j's run: every token in order, column topk - LEAD + j): those programs need
    # nothing the previous launch (the router, which releases this one early) writes, so they
    # start without waiting and stream the shared weights while it still routes.
    tblocks = tl.cdiv(tokens, BLOCK_M)
    lead = pid_m < LEAD * tblocks
    rest = pid_m >= LEAD * tblocks
    if LEAD > 0:
        if rest:
            wait_for_previous(PDL)
    else:
        wait_for_previous(PDL)
    # The sort's outputs; a leading program reads them too (they may be half written) and
    # uses none of it.
    if rest & (pid_m * BLOCK_M >= tl.load(USED)):  # a block the worst case allowed for, unused
        return
    expert = tl.load(BLOCK_EXPERT + pid_m).to(tl.int64)
    if rest & (expert == others):  # expert parallel: other ranks' assignments (down: zeros)
        return
    assign = tl.load(SORTED + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    if LEAD > 0:
        j = pid_m // tblocks
        token = (pid_m - j * tblocks) * BLOCK_M + tl.arange(0, BLOCK_M)
        expert = tl.where(lead, routed + j, expert).to(tl.int64)
        assign = tl.where(lead, tl.where(token < tokens, token * topk + (topk - LEAD + j), n),
                          assign)
    valid = assign < n
    token = (assign // topk).to(tl.int64)  # x's row read in place: no gathered copy
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    ks = tl.arange(0, BLOCK_K)
    a_ptr = X + token[:, None] * x_stride + ks[None, :]
    # [BLOCK_K, BLOCK_N] tiles of the expert's gate rows and of its up rows (inter rows later).
    g_ptr = W13 + expert * w_stride_e + cols[None, :].to(tl.int64) * w_stride_n + ks[:, None]
    u_ptr = g_ptr + inter * w_stride_n
    if HAS_SHARED:
        if expert >= routed:  # a shared expert: rows of the shared MLP's own gate and up
            shared_cols = ((expert - routed) * inter + cols[None, :]).to(tl.int64)
            g_ptr = SG + shared_cols * sg_stride + ks[:, None]
            u_ptr = SU + shared_cols * su_stride + ks[:, None]
    # FP8 experts: the scale rows of this tile's columns, in the gate's grid and the up's.
    sg_ptr = S13 + expert * s_stride_e + (cols // BR).to(tl.int64) * s_stride_n
    su_ptr = sg_ptr + up_row0 * s_stride_n
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, tl.cdiv(dim, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptr, mask=valid[:, None], other=0.0)
            g = tl.load(g_ptr, mask=col_ok[None, :], other=0.0)
            u = tl.load(u_ptr, mask=col_ok[None, :], other=0.0)
        else:
            k_ok = ks < dim - k * BLOCK_K
            a = tl.load(a_ptr, mask=valid[:, None] & k_ok[None, :], other=0.0)
            g = tl.load(g_ptr, mask=col_ok[None, :] & k_ok[:, None], other=0.0)
            u = tl.load(u_ptr, mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        if FP8:
            g = dequantize_tile(g, sg_ptr, k * BLOCK_K, dim, col_ok, BC, SCALE_VEC, BLOCK_K,
                            X.dtype.element_ty)
            u = dequantize_tile(u, su_ptr, k * BLOCK_K, dim, col_ok, BC, SCALE_VEC, BLOCK_K,
                            X.dtype.element_ty)
        if UPCAST:  # the interpreter multiplies bf16 tiles wrongly: float32 there
            a, g, u = a.to(tl.float32), g.to(tl.float32), u.to(tl.float32)
        acc_g = tl.dot(a, g, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, u, acc_u, input_precision=PRECISION)
        a_ptr += BLOCK_K
        g_ptr += BLOCK_K
        u_ptr += BLOCK_K
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u  # silu(gate) · up, before one rounding
    out = H + assign[:, None].to(tl.int64) * h_stride + cols[None, :]
    tl.store(out, h.to(H.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["n"])
def _down_kernel(H, W2, Y, SORTED, BLOCK_EXPERT, USED, WEIGHTS, n, dim, inter,
                 h_stride, w_stride_e, w_stride_n, y_stride,
                 SD, sd_stride, routed, HAS_SHARED: tl.constexpr,
                 S2, s_stride_e, s_stride_n, FP8: tl.constexpr, BR: tl.constexpr,
                 BC: tl.constexpr, SCALE_VEC: tl.constexpr, others,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                 RELEASE: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    if RELEASE:
        release_next(PDL)
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(USED):
        return
    expert = tl.load(BLOCK_EXPERT + pid_m).to(tl.int64)
    assign = tl.load(SORTED + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = assign < n
    rows = assign.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < dim
    if expert == others:  # expert parallel: another rank's expert adds nothing here
        tl.store(Y + rows[:, None] * y_stride + cols[None, :],
                 tl.zeros([BLOCK_M, BLOCK_N], Y.dtype.element_ty),
                 mask=valid[:, None] & col_ok[None, :])
        return
    ks = tl.arange(0, BLOCK_K)
    a_ptr = H + rows[:, None] * h_stride + ks[None, :]
    b_ptr = W2 + expert * w_stride_e + cols[None, :].to(tl.int64) * w_stride_n + ks[:, None]
    if HAS_SHARED:
        if expert >= routed:  # a shared expert: its columns of the shared MLP's down
            b_ptr = SD + cols[None, :].to(tl.int64) * sd_stride + (expert - routed) * inter \
                + ks[:, None]
    s_ptr = S2 + expert * s_stride_e + (cols // BR).to(tl.int64) * s_stride_n  # FP8 experts
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, tl.cdiv(inter, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptr, mask=valid[:, None], other=0.0)
            b = tl.load(b_ptr, mask=col_ok[None, :], other=0.0)
        else:
            k_ok = ks < inter - k * BLOCK_K
            a = tl.load(a_ptr, mask=valid[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptr, mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        if FP8:
            b = dequantize_tile(b, s_ptr, k * BLOCK_K, inter, col_ok, BC, SCALE_VEC, BLOCK_K,
                            H.dtype.element_ty)
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptr += BLOCK_K
        b_ptr += BLOCK_K
    weight = tl.load(WEIGHTS + rows, mask=valid, other=0.0)
    out = Y + rows[:, None] * y_stride + cols[None, :]
    tl.store(out, (acc * weight[:, None]).to(Y.dtype.element_ty),
             mask=valid[:, None] & col_ok[None, :])


@dataclass(frozen=True)
class MoETiles:
    """Tile sizes of one fused-MoE call: assignment rows per block (also the sort's padding
    unit), output columns per program (gate/up: intermediate columns, each program reading that
    many gate and as many up rows), reduction step, warps, pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int

    @classmethod
    def for_tokens(cls, tokens: int, topk: int, experts: int, dtype: torch.dtype,
                   fp8_block: tuple[int, int] | None = None) -> MoETiles:
        """The table, by assignments per expert (T·k / E; DeepSeek-V2-Lite: k 6 of 64):

        - ≤ 2 (decode up to ~16 tokens): 16-row blocks (tl.dot's least) and 32 columns: few
          blocks, so narrow columns give the most programs to stream the experts' weights
          (V2-Lite at T=1: 6 experts × 44 gate/up programs, two per SM); long K steps (128) and
          four stages keep many loads in flight per program.
        - ≤ 8 (decode up to ~64 tokens): 16-row blocks still hold an expert's rows (mostly one
          block per expert: weights read once); 64 columns, as many programs as there are SMs
          several times over.
        - ≤ 16 (~128 tokens): 32-row blocks so an expert's rows rarely split over two blocks
          (which read its weights twice).
        - ≤ 64 (prefill up to ~512): 64-row blocks start to reuse each weight tile.
        - above (prefill chunks): 128-row blocks × 128 columns, 8 warps: at T = 2048 on an
          H200 0.77 ms per V2-Lite layer against 0.88 with 64-row blocks and 1.00 for the
          grouped GEMMs (benchmarks/gpu/moe.py --sweep); the padding (up to 127 rows per
          expert) is small beside 192 rows per expert.

        float32 tiles (the exact path) take half the K step: twice the bytes per element.
        FP8 weights whose scale blocks (``fp8_block``: rows, columns) are narrower than the K
        step read a scale per weight, a tile as large as the weights', and keep two stages:
        a 16-block model asked 240 KB of shared memory at 128-row tiles and 258 KB at 16-row
        tiles of four stages, over an H100's 227 KB a program. DeepSeek-V3's 128-column blocks
        read one scale per row and K step."""
        per_expert = tokens * topk / max(1, experts)
        if per_expert <= 2:
            tiles = cls(16, 32, 128, 4, 4)
        elif per_expert <= 8:
            tiles = cls(16, 64, 128, 4, 4)
        elif per_expert <= 16:
            tiles = cls(32, 64, 128, 4, 3)
        elif per_expert <= 64:
            tiles = cls(64, 64, 64, 4, 3)
        else:
            tiles = cls(128, 128, 64, 8, 3)
        if dtype == torch.float32:
            tiles = cls(tiles.block_m, tiles.block_n, tiles.block_k // 2, tiles.num_warps,
                        min(tiles.num_stages, 3))
        if fp8_block is not None and fp8_block[1] % tiles.block_k:
            tiles = cls(tiles.block_m, tiles.block_n, tiles.block_k, tiles.num_warps,
                        min(tiles.num_stages, 2))
        return tiles


def max_rows(assignments: int, experts: int, block_m: int) -> int:
    """Rows the sorted assignments can need: each expert that has any pads to whole blocks."""
    return assignments + min(experts, assignments) * (block_m - 1)


@dataclass(frozen=True)
class Alignment:
    """Assignments sorted by expert into blocks (:func:`align_blocks`): ``rows`` [max_rows]
    (assignment index t·k + j, each expert's run padded to whole blocks with the sentinel
    T·k, experts in order, one expert's assignments in index order; entries from ``used`` on
    unspecified), ``block_expert`` [max_rows / block_m] (each block's expert, -1 past the used
    rows), ``used`` [1] (rows in use, whole blocks); int32, on the ids' device. ``block_m``
    and ``bins`` (the experts counted) say what it was sorted for; ``lead`` > 0: the last
    ``lead`` bins (the shared experts, which every token has) sorted first, then the others
    in order, so their blocks' rows are known without the sort."""

    rows: torch.Tensor
    block_expert: torch.Tensor
    used: torch.Tensor
    block_m: int
    bins: int
    lead: int = 0


@dataclass(frozen=True)
class AlignShape:
    """The sizes and scan steps :func:`_align_chunk` runs with for ``n`` assignments over
    ``bins`` experts in blocks of ``block_m``: buffers sized for the worst case, the counting
    scan's and the block table's steps kept within 16K one-hot lanes."""

    rows: int
    blocks: int
    e_p2: int
    scan: int
    chunk: int
    block_chunk: int

    @classmethod
    def of(cls, n: int, bins: int, block_m: int) -> AlignShape:
        rows = max_rows(n, bins, block_m)
        blocks = rows // block_m
        e_p2 = triton.next_power_of_2(bins)
        # V2's 64 experts: scans of 256; V3's 256: 64.
        return cls(rows, blocks, e_p2,
                   scan=max(16, min(triton.next_power_of_2(max(1, n)), (1 << 14) // e_p2)),
                   chunk=max(16, min(ALIGN_CHUNK, triton.next_power_of_2(max(1, n)))),
                   block_chunk=max(16, min(triton.next_power_of_2(blocks), (1 << 14) // e_p2)))

    def empty(self, device: torch.device, block_m: int, bins: int, lead: int = 0) -> Alignment:
        """Uninitialised outputs of this shape."""
        return Alignment(torch.empty(self.rows, dtype=torch.int32, device=device),
                         torch.empty(self.blocks, dtype=torch.int32, device=device),
                         torch.empty(1, dtype=torch.int32, device=device), block_m, bins, lead)


def align_blocks(ids: torch.Tensor, experts: int, block_m: int) -> Alignment:
    """The assignments of ``ids`` [T, k] (expert per token and slot, ``experts`` of them)
    sorted by expert in blocks of ``block_m`` rows (:class:`Alignment`). Nothing is read back
    to the host."""
    n = ids.numel()
    shape = AlignShape.of(n, experts, block_m)
    flat = ids.reshape(-1)
    if n > ALIGN_KERNEL_MAX:
        return Alignment(*_align_torch(flat, experts, block_m, shape.rows, shape.blocks),
                         block_m, experts)
    out = shape.empty(ids.device, block_m, experts)
    _align_kernel[(triton.cdiv(n, shape.chunk),)](
        flat, out.rows, out.block_expert, out.used, n, shape.blocks, E_P2=shape.e_p2,
        BLOCK_M=block_m, CHUNK=shape.chunk, SCAN=shape.scan, BLOCK_CHUNK=shape.block_chunk,
        **pdl_args(flat.device), num_warps=4)
    return out


def _align_torch(flat: torch.Tensor, experts: int, block_m: int, rows: int, blocks: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`align_blocks` in torch ops (no host reads either), for many assignments."""
    n, device = flat.numel(), flat.device
    order = flat.argsort(stable=True)
    counts = torch.zeros(experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat.long(), torch.ones_like(flat, dtype=torch.int64))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    skip = (ends - padded) - (counts.cumsum(0) - counts)  # padded start − unpadded start
    expert = flat[order].long()
    sorted_rows = torch.full((rows,), n, dtype=torch.int32, device=device)
    sorted_rows[torch.arange(n, device=device) + skip[expert]] = order.to(torch.int32)
    first = torch.arange(blocks, device=device) * block_m
    owner = torch.searchsorted(ends, first, right=True)
    block_expert = torch.where(first < ends[-1], owner, -1).to(torch.int32)
    return sorted_rows, block_expert, ends[-1:].to(torch.int32)


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor, tiles: MoETiles | None = None,
                  shared: SharedExperts | None = None,
                  scales: ExpertScales | None = None, first: int | None = None,
                  routed: int | None = None, summed: bool = True,
                  alignment: Alignment | None = None, release: bool = False) -> torch.Tensor:
    """The routed experts' output [T, D] in x's dtype: Σ_j weights[t, j] · expert_{ids[t, j]}(x_t)
    with expert_e(x) = w2[e] (silu(g) · u), [g; u] = w13[e] x — the same as
    :class:`~irminsul.model.moe.MoE`'s grouped-GEMM path. ``summed`` False: the terms of that
    sum [T, k, D] (each rounded to x's dtype), for a caller that sums them in a launch it makes
    anyway (:func:`~irminsul.kernels.fused_norm.add_rms_norm`).

    ``x`` [T, D]; ``w13`` [E, 2I, D] (gate rows, then up rows); ``w2`` [E, D, I]; ``weights``
    [T, k] (float32); ``ids`` [T, k] (distinct experts per token). ``tiles``: a launch shape
    (default :meth:`MoETiles.for_tokens`). The intermediate rows and the per-assignment outputs
    round once each to x's dtype; products and the sum over k accumulate in float32.

    ``shared``: the model's shared MLP taken as S more experts of width I (its intermediate
    columns ``j·I .. (j+1)·I`` are expert E + j, read in place from its own weights): ids E ..
    E + S − 1 (weight 1) then add the shared MLP's output to the sum — exactly, since an MLP's
    output is the sum over any split of its intermediate columns — and it costs no launches of
    its own (at batch 1 on an H200 the shared MLP was five kernels, ~20 µs per layer).

    ``scales``: ``w13`` / ``w2`` are float8 with these block scales (FP8 experts, read at one
    byte a weight): each weight tile is multiplied by its scales in float32 and rounded once to
    x's dtype before the dot, as dequantizing at load rounds it. Not with ``shared``.

    ``first`` (expert parallel, as :func:`~irminsul.model.moe.grouped_experts` takes it): ``w13``
    / ``w2`` hold experts ``first ..`` of the model's; assignments to other experts sort into
    one more bin whose rows the kernels skip (gate/up) and zero (down): this rank's share of the
    sum, with no host synchronisation. ``routed``: the model's routed experts, with ``first``:
    the default tiles are sized for the T·k/routed assignments each of this rank's experts
    expects, not T·k over the rank's own experts (W times too many at W ranks: V3 on 8 ranks at
    512 tokens took 128-row blocks for ~16 rows an expert).

    ``alignment``: ``ids`` already sorted into blocks (the router's launch did it:
    :func:`~irminsul.kernels.router.route_aligned`), for the routed and shared experts, in
    blocks of the tiles' ``block_m``; not under expert parallel. If it sorted the shared
    experts first (its ``lead``), their gate/up programs start without waiting for the launch
    before (which must then write nothing they read but the routing: the router's).

    ``release``: the down launch lets the next launch start once its programs have waited, for
    a next launch that reads its weights first (the next layer's joint projection,
    :func:`~irminsul.kernels.gemv.normed_gemv`)."""
    tokens, dim = x.shape
    experts, width, _ = w13.shape
    inter = width // 2
    topk = ids.shape[1]
    if w13.shape[2] != dim or w2.shape != (experts, dim, inter) or weights.shape != ids.shape:
        raise ValueError(f"shapes x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 "
                         f"{tuple(w2.shape)}, weights {tuple(weights.shape)}, ids "
                         f"{tuple(ids.shape)} do not fit")
    n_shared = 0 if shared is None else shared.count(dim, inter)
    if scales is not None and shared is not None:
        raise ValueError("the shared MLP is not folded into FP8 experts: run it on its own")
    if first is not None and shared is not None:
        raise ValueError("the shared MLP is not folded in under expert parallel (its ids are "
                         "the model's, not the rank's): run it on its own")
    s13, s2, (br, bc), up_row0 = _scale_args(scales, w13, w2, experts, dim, inter)
    n = tokens * topk
    if n == 0:
        return x.new_zeros(x.shape if summed else (tokens, topk, dim))
    sized_for = routed if first is not None and routed else experts + n_shared
    tiles = tiles or MoETiles.for_tokens(tokens, topk, sized_for, x.dtype,
                                         None if scales is None else scales.block)
    bm = tiles.block_m
    if x.stride(1) != 1:
        x = x.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()
    bins, others = experts + n_shared, -1  # -1: no bin is another rank's
    if first is not None:
        local = ids - first
        ids = torch.where((local >= 0) & (local < experts), local, bins)
        bins, others = bins + 1, bins
    if alignment is None:
        alignment = align_blocks(ids, bins, bm)
    elif (first is not None or (alignment.block_m, alignment.bins) != (bm, bins)
          or alignment.lead not in (0, n_shared)):
        raise ValueError(f"the alignment sorted {alignment.bins} experts into blocks of "
                         f"{alignment.block_m}, {alignment.lead} shared first; this call needs "
                         f"{bins} in blocks of {bm}, 0 or {n_shared} first"
                         + (" (and none under expert parallel)" if first is not None else ""))
    sorted_rows, block_expert, used = alignment.rows, alignment.block_expert, alignment.used
    grid_m = block_expert.numel()
    upcast = interpreted() and x.dtype != torch.float32
    precision = "ieee" if x.dtype == torch.float32 or upcast else "tf32"
    meta = dict(BLOCK_M=bm, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, UPCAST=upcast,
                PRECISION=precision, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
                FP8=scales is not None, BR=br, BC=bc,
                SCALE_VEC=bc % tiles.block_k == 0, **pdl_args(x.device))
    gate, up, down = (w13, w13, w2) if shared is None else (shared.gate, shared.up, shared.down)
    h = torch.empty(n, inter, dtype=x.dtype, device=x.device)
    # Programs start in grid order, blocks fastest (a weight tile's blocks side by side); with
    # a lead, columns fastest, so every leading program is among the first resident ones and
    # not queued behind the others' programs, which wait for the launch before.
    grid = (grid_m, triton.cdiv(inter, tiles.block_n))
    _gate_up_kernel[grid[::-1] if alignment.lead else grid](
        x, w13, h, sorted_rows, block_expert, used, n, tokens, topk, dim, inter,
        x.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
        gate, up, gate.stride(0), up.stride(0), experts, HAS_SHARED=shared is not None,
        LEAD=alignment.lead,
        S13=s13, s_stride_e=s13.stride(0), s_stride_n=s13.stride(1), up_row0=up_row0,
        others=others, EVEN_K=dim % tiles.block_k == 0, **meta)
    y = torch.empty(n, dim, dtype=x.dtype, device=x.device)
    _down_kernel[(grid_m, triton.cdiv(dim, tiles.block_n))](
        h, w2, y, sorted_rows, block_expert, used, weights.reshape(-1).float().contiguous(), n,
        dim, inter, h.stride(0), w2.stride(0), w2.stride(1), y.stride(0),
        down, down.stride(0), experts, HAS_SHARED=shared is not None,
        S2=s2, s_stride_e=s2.stride(0), s_stride_n=s2.stride(1), others=others,
        EVEN_K=inter % tiles.block_k == 0, RELEASE=release, **meta)
    if not summed:
        return y.view(tokens, topk, dim)
    if topk == 1:
        return y
    # Sum over k in one kernel: torch's reductions of bf16 accumulate in float32 (on both
    # devices) and round once.
    return y.view(tokens, topk, dim).sum(1)


@dataclass(frozen=True)
class ExpertScales:
    """FP8 experts' block scales as :func:`fused_experts` reads them (the MoE's
    ``w13_scale_inv`` / ``w2_scale_inv``): weight[e, m, n] = float(wq[e, m, n]) ·
    scale[e, m // br, n // bc], with ``w13``'s grid each expert's gate grid then its up grid."""

    w13: torch.Tensor  # [E, 2·⌈I/br⌉, ⌈D/bc⌉] float32
    w2: torch.Tensor  # [E, ⌈D/br⌉, ⌈I/bc⌉] float32
    block: tuple[int, int]  # (br, bc)


def _scale_args(scales: ExpertScales | None, w13: torch.Tensor, w2: torch.Tensor, experts: int,
                dim: int, inter: int
                ) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int], int]:
    """The kernels' scale arguments: (w13's grid, w2's grid, block, the up grid's first row);
    without scales, placeholders the kernels never read."""
    if scales is None:
        return w13, w2, (1, 1), 0
    br, bc = scales.block
    rows = -(-inter // br)
    want = {"w13": (experts, 2 * rows, -(-dim // bc)), "w2": (experts, -(-dim // br),
                                                                -(-inter // bc))}
    for name, grid in (("w13", scales.w13), ("w2", scales.w2)):
        if tuple(grid.shape) != want[name]:
            raise ValueError(f"FP8 experts: {name}'s scales {tuple(grid.shape)} do not fit "
                             f"blocks {scales.block} of {tuple((w13 if name == 'w13' else w2).shape)}"
                             f" (need {want[name]})")
    if w13.dtype != torch.float8_e4m3fn or w2.dtype != torch.float8_e4m3fn:
        raise ValueError(f"FP8 experts: weights are {w13.dtype} / {w2.dtype}, not float8_e4m3fn")
    return scales.w13.float().contiguous(), scales.w2.float().contiguous(), (br, bc), rows


@dataclass(frozen=True)
class SharedExperts:
    """A shared MLP's weights as :func:`fused_experts` reads them: gate and up [S·I, D], down
    [D, S·I] (the checkpoint's ``shared_experts.{gate,up,down}_proj.weight``, last dim
    contiguous)."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor

    def count(self, dim: int, inter: int) -> int:
        """S, the experts of width ``inter`` this MLP makes; raises if it is not a whole number
        of them over a ``dim``-wide model."""
        width = self.gate.shape[0]
        if (width % inter or self.gate.shape != (width, dim) or self.up.shape != (width, dim)
                or self.down.shape != (dim, width)
                or any(w.stride(-1) != 1 for w in (self.gate, self.up, self.down))):
            raise ValueError(f"shared MLP gate {tuple(self.gate.shape)}, up "
                             f"{tuple(self.up.shape)}, down {tuple(self.down.shape)} is not "
                             f"a whole number of {inter}-wide experts over {dim} dims")
        return width // inter
