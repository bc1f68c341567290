"""Absorbed MLA attention read in place from the split pool: decode and prefill in one kernel.

Every query head attends to the request's latent rows as one shared KV head (the absorbed form of
:mod:`irminsul.model.mla`): score = q̃·c_KV + q_r·k_r, value = c_KV. A request's rows are named by
two index lists, c_KV slots and k_r slots (the split pool), in position order; its new tokens are
the last ``nq`` of them, so causality by absolute position is causality by list index. Queries are
folded (token, head) → row ``token·H + head``, so a block of rows shares every key it loads; one
launch covers a ragged batch of requests (decode steps and prefill segments alike).

Long contexts with few query rows are split along the keys (flash-decoding): each split writes a
partial output and its log-sum-exp, merged afterwards. Reused k_r rows are read as stored: the
engine materialises their rotation once per reuse (:mod:`.rotate`), so every read after that is a
plain load.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from ..device import SMS, sm_count, upload
from .launch import pdl_args, release_next, wait_for_previous

SM_TARGET = 2 * SMS  # programs to aim for: two waves over an H100/H200's 132 SMs
LOG2E = 1.4426950408889634
_SPLIT_ALIGN = tl.constexpr(64)  # split lengths are multiples of this many keys
SCHEDULE_WAVES = 2  # programs per SM a scheduled (16-row) launch's pieces fill at most
# 16-row launches of fewer blocks split each request's keys evenly (splits for one wave already
# balance a few blocks, and the pieces' merge costs more than it saves there): an H200 measure.
PIECES_FROM_BLOCKS = 16
SCHEDULE_LEAST = 64  # keys a piece holds at least
# Key splits per request at most, by rows per block (key_splits); every power of two up to it is
# a variant compiled at engine start (attention_variants).
MAX_SPLITS = {16: 128, 64: 64}
# A piece's chunk is rounded up to a multiple of this many keys (the 16-row tile's step): as
# many steps a program, fewer pieces to merge. agent_meta's forward at 16K keys, one layer on an
# H100: 66 -> 43 µs; other short forwards and decode steps within ±5%
# (benchmarks/gpu/span_attention.py).
SCHEDULE_ALIGN = 64
# The pieces' merge reads MERGE_ROWS rows a program in launches of up to MERGE_BY_ROW_UP_TO
# blocks, else a whole block a program (see _scheduled).
MERGE_ROWS, MERGE_BY_ROW_UP_TO = 16, 0
# Forwards of up to this many tokens, where heads are fewer than 64, read keys one token's heads
# per block (16 rows) and in pieces, as decode steps do. A live-PIC prefill computes a few
# tokens, most seeing few keys (a changed header) and one or a few every key (the prompt's last);
# in 64-row blocks split evenly, the last token's block read every key in ~30 programs of
# 64-row steps. One layer on an H100 (benchmarks/gpu/span_attention.py): agent_meta's forward
# at 16K keys 116 -> 43 µs, at 32K 226 -> 64; N new tokens at the end of 4K-32K keys 1.2-2.8x
# faster at every N measured (8 to 512); decode steps unchanged.
SHORT_FORWARD = 512
# A split launch's merge releases the next launch early when asked (paged_mla_attention's
# ``release``: W_UV's GEMV, which reads its weight before its wait). A switch for an A/B.
MERGE_RELEASES = True


@triton.jit
def _attend_keys(q_nope, q_r, CKV, KR, KV_CKV, KV_KR, kv0, start, end, visible, c_stride,
                 r_stride, scale_log2, vcols, m_i, l_i, acc,
                 RANK: tl.constexpr, ROPE: tl.constexpr, ROPE_P2: tl.constexpr,
                 BLOCK_N: tl.constexpr, DV: tl.constexpr, PRECISION: tl.constexpr):
    """Online softmax of a block's rows over keys ``start:end`` of its request (entries ``kv0 +
    key`` of the slot lists): the running max, sum and output, updated."""
    # q_r·k_r is a plain dot product over the rope dims: the rotary's pair layout does not
    # matter here (rows are stored rotated), so both are read whole and contiguous.
    dims, rdims = tl.arange(0, RANK), tl.arange(0, ROPE_P2)
    rope_ok = rdims < ROPE
    for n in range(start, end, BLOCK_N):
        keys = n + tl.arange(0, BLOCK_N)
        key_ok = keys < end
        c_slot = tl.load(KV_CKV + kv0 + keys, mask=key_ok, other=0).to(tl.int32).to(tl.int64)
        r_slot = tl.load(KV_KR + kv0 + keys, mask=key_ok, other=0).to(tl.int32).to(tl.int64)
        c = tl.load(CKV + c_slot[:, None] * c_stride + dims[None, :], mask=key_ok[:, None],
                    other=0.0)
        k_r = tl.load(KR + r_slot[:, None] * r_stride + rdims[None, :],
                      mask=key_ok[:, None] & rope_ok[None, :], other=0.0)
        s = tl.dot(q_nope, tl.trans(c), input_precision=PRECISION)
        s += tl.dot(q_r, tl.trans(k_r), input_precision=PRECISION)
        # A step may run past its range's end (a split's or a chunk's): keys there are
        # another program's, visible or not.
        seen = (keys[None, :] < visible[:, None]) & key_ok[None, :]
        s = tl.where(seen, s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if DV == RANK:
            v = c
        else:
            v = tl.load(CKV + c_slot[:, None] * c_stride + vcols[None, :], mask=key_ok[:, None],
                        other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _block_rows(BLK_REQ, BLK_ROW0, REQ_Q0, REQ_NQ, REQ_KV0, REQ_KVLEN, blk, heads,
                BLOCK_M: tl.constexpr):
    """A block's request (first key entry, keys) and its folded rows: which are real, their
    batch rows ``(q0 + token)·H + head``, and how many keys each may see (itself included)."""
    # Tables may come as int64 (a CUDA graph's staging buffer): int32 from here on, as the
    # int32 tables of an eager launch. int64 block and request values cost 1.3-2.9x in time
    # (H200, batches of 64-128).
    req = tl.load(BLK_REQ + blk).to(tl.int32)
    q0, nq = tl.load(REQ_Q0 + req).to(tl.int32), tl.load(REQ_NQ + req).to(tl.int32)
    kv0, kvlen = tl.load(REQ_KV0 + req).to(tl.int64), tl.load(REQ_KVLEN + req).to(tl.int32)
    rows = tl.load(BLK_ROW0 + blk).to(tl.int32) + tl.arange(0, BLOCK_M)
    row_ok = rows < nq * heads
    grow = (q0 * heads + rows).to(tl.int64)
    visible = kvlen - nq + rows // heads + 1
    return kv0, kvlen, row_ok, grow, visible


@triton.jit
def _load_query(Q, grow, row_ok, q_stride, RANK: tl.constexpr, ROPE: tl.constexpr,
                ROPE_P2: tl.constexpr):
    dims, rdims = tl.arange(0, RANK), tl.arange(0, ROPE_P2)
    q_rows = Q + grow[:, None] * q_stride
    q_nope = tl.load(q_rows + dims[None, :], mask=row_ok[:, None], other=0.0)
    q_r = tl.load(q_rows + RANK + rdims[None, :], mask=row_ok[:, None] & (rdims < ROPE)[None, :],
                  other=0.0)
    return q_nope, q_r


@triton.jit(do_not_specialize=["out_rows"])
def _mla_kernel(Q, CKV, KR, OUT, LSE, KV_CKV, KV_KR,
                BLK_REQ, BLK_ROW0, REQ_Q0, REQ_NQ, REQ_KV0, REQ_KVLEN,
                heads, scale_log2, q_stride, c_stride, r_stride, out_rows,
                RANK: tl.constexpr, ROPE: tl.constexpr, ROPE_P2: tl.constexpr,
                SPLIT: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DV: tl.constexpr,
                PRECISION: tl.constexpr,
                PDL: tl.constexpr):
    wait_for_previous(PDL)
    blk, split, vblk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kv0, kvlen, row_ok, grow, visible = _block_rows(BLK_REQ, BLK_ROW0, REQ_Q0, REQ_NQ,
                                                    REQ_KV0, REQ_KVLEN, blk, heads, BLOCK_M)
    # Each request splits its own keys evenly over the launch's splits (in whole steps of 64
    # keys): the grid does not depend on the batch's lengths, so a captured launch serves any.
    split_len = tl.cdiv(tl.cdiv(kvlen, tl.num_programs(1)), _SPLIT_ALIGN) * _SPLIT_ALIGN
    start = split * split_len
    end = tl.minimum(start + split_len, tl.max(tl.where(row_ok, visible, 0)))
    q_nope, q_r = _load_query(Q, grow, row_ok, q_stride, RANK, ROPE, ROPE_P2)
    m_i = tl.full([BLOCK_M], -1e30, tl.float32)  # finite: a fully masked block stays NaN-free
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DV], tl.float32)
    vcols = vblk * DV + tl.arange(0, DV)
    m_i, l_i, acc = _attend_keys(q_nope, q_r, CKV, KR, KV_CKV, KV_KR, kv0, start, end, visible,
                                 c_stride, r_stride, scale_log2, vcols, m_i, l_i, acc,
                                 RANK, ROPE, ROPE_P2, BLOCK_N, DV, PRECISION)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if SPLIT:
        # A row that sees no key of this split (a split past a short request's keys, in a
        # launch split for long ones) stores only its log-sum-exp, −inf: the merge reads no
        # partial output for it.
        at = (split * out_rows + grow)
        tl.store(OUT + at[:, None] * RANK + vcols[None, :], out,
                 mask=(row_ok & (visible > start))[:, None])
        lse = tl.where(l_i > 0, m_i + tl.log2(l_i), float("-inf"))
        if vblk == 0:  # one log-sum-exp per row, whichever value columns a program has
            tl.store(LSE + at, lse, mask=row_ok)
    else:
        tl.store(OUT + grow[:, None] * RANK + vcols[None, :], out.to(OUT.dtype.element_ty),
                 mask=row_ok[:, None])


@triton.jit(do_not_specialize=["blocks"])
def _mla_pieces_kernel(Q, CKV, KR, OUT, PART, PART_LSE, KV_CKV, KV_KR,
                       BLK_REQ, BLK_ROW0, REQ_Q0, REQ_NQ, REQ_KV0, REQ_KVLEN, SCHED,
                       blocks, heads, scale_log2, q_stride, c_stride, r_stride,
                       RANK: tl.constexpr, ROPE: tl.constexpr, ROPE_P2: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       PRECISION: tl.constexpr,
                       PDL: tl.constexpr):
    wait_for_previous(PDL)
    # One piece of one block's keys per program (SCHED, see PagedLayout.plan): a block read in
    # one piece gets its output here, a block cut into several a partial output per piece, in
    # the piece's slot, merged by _merge_pieces_kernel. Programs past the batch's pieces idle.
    i, room = tl.program_id(0), tl.num_programs(0)
    # Idle programs read block 0 over no keys and store nothing: no branch around the loop,
    # which would keep the compiler from pipelining it as it pipelines the split kernel's.
    live = i < tl.load(SCHED)
    b = tl.where(live, tl.load(SCHED + 1 + i).to(tl.int32), 0)
    start = tl.load(SCHED + 1 + room + i).to(tl.int32)
    end = tl.where(live, tl.load(SCHED + 1 + 2 * room + i).to(tl.int32), start)
    whole = tl.load(SCHED + 1 + 3 * room + blocks + b) == 1
    kv0, _, row_ok, grow, visible = _block_rows(BLK_REQ, BLK_ROW0, REQ_Q0, REQ_NQ, REQ_KV0,
                                                REQ_KVLEN, b, heads, BLOCK_M)
    row_ok = row_ok & (tl.arange(0, BLOCK_M) < tl.where(live, BLOCK_M, 0))
    q_nope, q_r = _load_query(Q, grow, row_ok, q_stride, RANK, ROPE, ROPE_P2)
    m_i = tl.full([BLOCK_M], -1e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, RANK], tl.float32)
    vcols = tl.arange(0, RANK)
    m_i, l_i, acc = _attend_keys(q_nope, q_r, CKV, KR, KV_CKV, KV_KR, kv0, start, end, visible,
                                 c_stride, r_stride, scale_log2, vcols, m_i, l_i, acc,
                                 RANK, ROPE, ROPE_P2, BLOCK_N, RANK, PRECISION)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if whole:
        tl.store(OUT + grow[:, None] * RANK + vcols[None, :], out.to(OUT.dtype.element_ty),
                 mask=row_ok[:, None])
    else:
        r = tl.arange(0, BLOCK_M)
        at = (i * BLOCK_M + r).to(tl.int64)
        keep = r < tl.where(live, BLOCK_M, 0)  # every row of a live program's slot
        tl.store(PART + at[:, None] * RANK + vcols[None, :], out, mask=keep[:, None])
        tl.store(PART_LSE + at, tl.where(l_i > 0, m_i + tl.log2(l_i), float("-inf")), mask=keep)


@triton.jit(do_not_specialize=["room", "blocks"])
def _merge_pieces_kernel(PART, PART_LSE, OUT, SCHED, BLK_REQ, BLK_ROW0, REQ_Q0, REQ_NQ,
                         heads, room, blocks, RANK: tl.constexpr, BLOCK_M: tl.constexpr,
                         ROWS: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr,
                         PDL: tl.constexpr):
    wait_for_previous(PDL)
    # ROWS of one block's rows from its pieces' partial outputs (slots first .. first +
    # count − 1), read GROUP pieces at a time: one wide load each, not a chain of small ones.
    at_b, dblk = tl.program_id(0), tl.program_id(1)
    b, r0 = at_b // (BLOCK_M // ROWS), (at_b % (BLOCK_M // ROWS)) * ROWS
    first = tl.load(SCHED + 1 + 3 * room + b).to(tl.int32)
    count = tl.load(SCHED + 1 + 3 * room + blocks + b).to(tl.int32)
    if count > 1:
        req = tl.load(BLK_REQ + b)
        r = r0 + tl.arange(0, ROWS)
        rows = tl.load(BLK_ROW0 + b) + r
        row_ok = rows < tl.load(REQ_NQ + req) * heads
        grow = (tl.load(REQ_Q0 + req) * heads + rows).to(tl.int64)
        d = dblk * BLOCK_D + tl.arange(0, BLOCK_D)
        top = tl.full([ROWS], float("-inf"), tl.float32)
        for g in range(0, count, GROUP):
            piece = g + tl.arange(0, GROUP)
            at = ((first + piece)[:, None] * BLOCK_M + r[None, :]).to(tl.int64)
            lse = tl.load(PART_LSE + at, mask=(piece < count)[:, None], other=float("-inf"))
            top = tl.maximum(top, tl.max(lse, 0))
        top = tl.where(top == float("-inf"), 0.0, top)
        total = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
        for g in range(0, count, GROUP):
            piece = g + tl.arange(0, GROUP)
            at = ((first + piece)[:, None] * BLOCK_M + r[None, :]).to(tl.int64)  # [GROUP, ROWS]
            used = (piece < count)[:, None]
            weight = tl.exp2(tl.load(PART_LSE + at, mask=used, other=float("-inf")) - top[None, :])
            part = tl.load(PART + at[:, :, None] * RANK + d[None, None, :], mask=used[:, :, None],
                           other=0.0)
            acc += tl.sum(part * weight[:, :, None], 0)
            total += tl.sum(weight, 0)
        out = acc / tl.where(total > 0, total, 1.0)[:, None]
        tl.store(OUT + grow[:, None] * RANK + d[None, :], out.to(OUT.dtype.element_ty),
                 mask=row_ok[:, None])


@dataclass
class PagedLayout:
    """Where a ragged batch's keys are: built once per batch on the host, used by every layer.

    For request i: its queries are tokens ``q_start[i] : q_start[i] + new[i]`` of the batch, its
    keys entries ``kv_start[i] : kv_start[i] + kv_len[i]`` of the index lists (its new tokens last).
    Work is divided one of two ways: each request's keys split evenly over ``splits`` programs
    per block, or (``schedule``, 16-row blocks) each block's keys cut by their length into
    pieces of at most a chunk, one program per piece (:meth:`plan`).
    """

    kv_ckv: torch.Tensor  # int32 [total keys] c_KV slots
    kv_kr: torch.Tensor  # int32 [total keys] k_r slots
    requests: torch.Tensor  # int32 [4, B]: q_start, new, kv_start, kv_len
    block_req: torch.Tensor  # int32 [blocks]: the request of each block of query rows
    block_row0: torch.Tensor  # int32 [blocks]: its first folded row within the request
    tokens: int
    heads: int
    block_m: int
    splits: int
    schedule: torch.Tensor | None = None  # [1 + 3·programs + 2·blocks]: see plan()
    programs: int = 0  # room for pieces: the scheduled launch's grid

    @classmethod
    def build(cls, new: list[int], kv_ckv: list[np.ndarray], kv_kr: list[np.ndarray], heads: int,
              device: torch.device | str, block_m: int | None = None,
              splits: int | None = None, programs: int | None = None,
              least: int = SCHEDULE_LEAST, align: int | None = None) -> PagedLayout:
        """Layout of requests with ``new[i]`` new tokens and key slot lists ``kv_ckv[i]`` /
        ``kv_kr[i]`` (every key in position order, the new tokens' own rows last), in blocks of
        ``block_m`` query rows (default :func:`rows_per_block`). 16-row blocks,
        :data:`PIECES_FROM_BLOCKS` or more, are cut into pieces for about ``programs`` programs
        (default :func:`scheduled_programs`; pieces of at least ``least`` keys, chunks a
        multiple of ``align``, default :data:`SCHEDULE_ALIGN`) unless
        ``splits`` is given; otherwise each request's keys are split over ``splits`` programs (default:
        enough for two waves, at least 256 keys each)."""
        kv_len = [len(s) for s in kv_ckv]
        if any(n < 1 or n > k for n, k in zip(new, kv_len)):
            raise ValueError("each request needs 1..len(keys) new tokens among its keys")
        if block_m is None:
            block_m = rows_per_block(sum(new), max(new), heads)
        block_req, block_row0 = cls.blocks(new, heads, block_m)

        def ints(values: np.ndarray | list) -> torch.Tensor:
            return upload(values, device, np.int32)

        schedule = None
        if splits is None and (programs is not None or in_pieces(block_m, len(block_req))):
            work = cls.block_work(new, kv_len, heads, block_req, block_row0, block_m)
            plan = cls.plan(work, programs or scheduled_programs(device), least, align=align)
            schedule, splits, programs = ints(plan), 1, int(plan[0])  # room: the pieces
        elif splits is None:
            splits = key_splits(len(block_req), block_m, device, max(kv_len))
        return cls(ints(np.concatenate(kv_ckv)), ints(np.concatenate(kv_kr)),
                   ints(cls.request_table(new, kv_len)), ints(block_req), ints(block_row0),
                   sum(new), heads, block_m, splits, schedule, programs or 0)

    @staticmethod
    def blocks(new: list[int], heads: int, block_m: int) -> tuple[np.ndarray, np.ndarray]:
        """(request, first folded query row) of every block of ``block_m`` rows."""
        rows = [np.arange(0, n * heads, block_m) for n in new]
        return np.repeat(np.arange(len(new)), [r.size for r in rows]), np.concatenate(rows)

    @staticmethod
    def request_table(new: list[int], kv_len: list[int]) -> np.ndarray:
        """[4, requests rounded up to a multiple of 4]: first query token, new tokens, first key
        entry, keys. The rounding keeps each row's start 16-byte aligned as int32, so a kernel
        reading the rows compiles once: Triton specialises a pointer argument on that alignment,
        and a batch of another request count mod 4 compiled it again (~1-2 s on the first token
        of whichever request met it)."""
        table = np.stack([np.cumsum([0, *new[:-1]]), new, np.cumsum([0, *kv_len[:-1]]), kv_len])
        return np.pad(table, ((0, 0), (0, -len(new) % 4)))

    @staticmethod
    def block_work(new: list[int], kv_len: list[int], heads: int, block_req: np.ndarray,
                   block_row0: np.ndarray, block_m: int) -> np.ndarray:
        """Keys each block reads: those its last row may see (causal by list index)."""
        nq, keys = np.asarray(new)[block_req], np.asarray(kv_len)[block_req]
        last = np.minimum(block_row0 + block_m, nq * heads) - 1
        return keys - nq + last // heads + 1

    @staticmethod
    def plan(work: np.ndarray, programs: int, least: int = SCHEDULE_LEAST,
             room: int | None = None, align: int | None = None) -> np.ndarray:
        """The pieces of blocks reading ``work`` keys each, as the kernel reads them: ``[pieces,
        block, first key, end key (room entries each), first piece, pieces (one per block)]``.

        Each block's keys are cut into equal pieces of at most a chunk, split by its length as
        FlashMLA's scheduler splits each request: a long request among short ones is read by
        many programs, a short one by one. The chunk is the shortest (at least ``least`` keys)
        that keeps the pieces within ``programs`` — one wave, not a partial second one — or,
        with more blocks than programs, one piece per block; rounded up to a multiple of
        ``align`` keys (default :data:`SCHEDULE_ALIGN`): pieces of whole steps of the kernel's
        tile take as many steps as any shorter chunk's, in fewer pieces. At most ``programs`` +
        blocks pieces: the ``room`` (default: exactly the pieces) a launch's grid holds."""
        work = np.asarray(work, dtype=np.int64)
        used = work[work > 0]
        lo, hi = least, max(least, int(used.max(initial=0)))
        while lo < hi:  # Σ ceil(work / chunk) falls as the chunk grows
            mid = (lo + hi) // 2
            if int((-(-used // mid)).sum()) <= programs:
                hi = mid
            else:
                lo = mid + 1
        align = SCHEDULE_ALIGN if align is None else align
        lo = -(-lo // align) * align
        count = -(-work // lo)
        size = -(-work // np.maximum(count, 1))
        block = np.repeat(np.arange(work.size), count)
        first = np.cumsum(count) - count
        start = (np.arange(block.size) - first[block]) * size[block]
        end = np.minimum(start + size[block], work[block])
        room = block.size if room is None else room
        if block.size > room:
            raise ValueError(f"{block.size} pieces exceed the launch's room of {room}")
        table = np.zeros(1 + 3 * room + 2 * work.size, dtype=np.int64)
        table[0] = block.size
        for k, values in enumerate((block, start, end)):
            table[1 + k * room:1 + k * room + block.size] = values
        table[1 + 3 * room:] = np.concatenate([first, count])
        return table


def rows_per_block(tokens: int, longest: int, heads: int) -> int:
    """Query rows per block of an eager launch over ``tokens`` new tokens whose longest span
    has ``longest``: 16 where one span's heads fill no more (decode steps) or, with fewer than
    64 heads, for a forward of up to :data:`SHORT_FORWARD` tokens; else 64, where a long span's
    tokens share each read of their keys four (16 heads) to one (64+) at a time."""
    return 16 if longest * heads <= 16 or (heads < 64 and tokens <= SHORT_FORWARD) else 64


def in_pieces(block_m: int, blocks: int) -> bool:
    """Whether a launch of ``blocks`` blocks of ``block_m`` rows is cut into pieces (else
    split evenly per request): 16-row blocks, :data:`PIECES_FROM_BLOCKS` or more."""
    return block_m == 16 and blocks >= PIECES_FROM_BLOCKS


def scheduled_programs(device: torch.device | str) -> int:
    """Programs a scheduled launch's pieces fill: :data:`SCHEDULE_WAVES` per SM on a GPU; a
    few under Triton's CPU interpreter, which runs programs one after another."""
    if torch.device(device).type != "cuda":
        return 4
    return SCHEDULE_WAVES * sm_count(device)


def key_splits(blocks: int, block_m: int, device: torch.device | str,
               max_keys: int | None = None) -> int:
    """Key splits per request for a launch of ``blocks`` blocks of query rows.

    16-row blocks (decode: one token's heads each) are read-bound, and one program streams its
    keys at about half of an SM's share of the bandwidth whatever else runs there: one wave of
    programs, blocks × splits ≈ the SMs, with splits a power of two, is fastest on an H200 at
    batch 1 to 128 and 4K to 16K keys (benchmarks/gpu/decode_attention.py). 64-row blocks (prefill)
    aim at two waves. Splits stay within 128 (16-row: one request's decode step over 16K keys
    took 12.6 µs as 128 splits against 17.0 as 64 on an H200; splits past a short request's
    keys cost little, see :func:`merge_splits`) or 64 (64-row) and, given the longest request's
    ``max_keys``, keep at least 64 (16-row) or 256 (64-row) keys each, rounded up to a power of
    two: the merge compiles once per split count (a constexpr), and :func:`compile_variants`
    can then compile every count a launch may take before serving."""
    if block_m == 16:
        splits = 1 << max(0, (sm_count(device) // max(1, blocks)).bit_length() - 1)
        least, most = 64, MAX_SPLITS[16]
    else:
        splits, least, most = -(-SM_TARGET // max(1, blocks)), 256, MAX_SPLITS[64]
    if max_keys is not None:
        splits = min(splits, -(-max_keys // least))
    return triton.next_power_of_2(max(1, min(most, splits)))


def attention_variants() -> list[tuple[int, int, bool]]:
    """Every (rows per block, key splits, in pieces) a :class:`PagedLayout` can take — 16-row
    blocks split 1 to 128 ways (powers of two) or in pieces, 64-row blocks split 1 to 64 ways —
    each a variant of the kernels compiled apart (block size, split or not, tiles, the merge's
    split count)."""
    return ([(block_m, 1 << i, False) for block_m, most in MAX_SPLITS.items()
             for i in range(most.bit_length())] + [(16, 1, True)])


def compile_variants(ckv: torch.Tensor, kr: torch.Tensor, heads: int, scale: float) -> int:
    """Launch each of :func:`attention_variants` over a few keys of ``ckv`` [slots, rank] /
    ``kr`` [slots, rope] (a pool layer's rows: read, left as they are; the outputs discarded),
    so that none compiles on a request's clock: Triton compiles a variant the first time it
    runs (1–2 s on an H100), and a CUDA graph's capture meets only the decode buckets'.
    Returns the launches run."""
    rank, rope = ckv.shape[1], kr.shape[1]
    keys = np.zeros(64, dtype=np.int64)  # slot 0, 64 times
    variants = attention_variants()
    for block_m, splits, pieces in variants:
        new = [1] * (PIECES_FROM_BLOCKS if pieces else 1)
        how = {"programs": scheduled_programs(ckv.device)} if pieces else {"splits": splits}
        layout = PagedLayout.build(new, [keys] * len(new), [keys] * len(new), heads, ckv.device,
                                   block_m=block_m, **how)
        q = torch.zeros(len(new), heads, rank + rope, dtype=ckv.dtype, device=ckv.device)
        paged_mla_attention(q, ckv, kr, layout, scale)
    return len(variants)


@dataclass(frozen=True)
class TileConfig:
    """Tile sizes of one launch: keys per step, value columns per program, warps, stages."""

    block_n: int
    dv: int
    num_warps: int
    num_stages: int

    @classmethod
    def default(cls, block_m: int, rank: int, dtype: torch.dtype, splits: int = 1
                ) -> TileConfig:
        """Every block keeps the whole value width (recomputing q·k per value split costs more
        than it saves). Decode blocks (16 rows) step 64 keys with 8 warps and two stages —
        128 keys where a launch splits each request's keys 2 to 32 ways (a few requests, each
        split 128 keys long or more at 4K: 10–18% faster at batch 8, 4K–16K keys, on an H200;
        6–25% at batch 4's 32 splits on an H100; slower for batch 1–2's 64–128 splits of
        64–128 keys at 4K) — prefill blocks (64 rows) 32 keys with 8 warps and one stage: the
        fastest of the shapes benchmarks/gpu/decode_attention.py and kernels.py try.
        float32 tiles are twice the bytes: fewer keys per step."""
        wide = dtype == torch.float32
        if block_m == 16:
            if wide:
                return cls(32, rank, 4, 2)
            return cls(128 if 1 < splits <= 32 else 64, rank, 8, 2)
        return cls(16 if wide else 32, rank, 8, 1)


def paged_mla_attention(q: torch.Tensor, ckv: torch.Tensor, kr: torch.Tensor,
                        layout: PagedLayout, scale: float,
                        tiles: TileConfig | None = None, *, release: bool = False
                        ) -> torch.Tensor:
    """Absorbed attention of queries q [T, H, rank + rope] (q̃_nope | q_rope) over the pool's
    rows ckv [slots, rank] / kr [slots, rope] named by ``layout``; returns [T, H, rank] in q's
    dtype (the latent-space output, before W_UV); q_rope and the k_r rows are rotated already, in the
    same pair layout. ``tiles`` overrides the default tile sizes
    (split lengths are multiples of 64 keys: a block_n above 64 masks the rest of its last step).
    ``release``: a split launch's merge lets the next launch start once its programs have
    waited (for a next launch that reads its weights first, :mod:`.gemv`)."""
    tokens, heads, width = q.shape
    rank, rope = ckv.shape[1], kr.shape[1]
    if width != rank + rope or rank & (rank - 1) or rank < 16:
        raise ValueError(f"query width {width} != {rank} + {rope}, or rank not a power of two")
    if tokens != layout.tokens or heads != layout.heads:
        raise ValueError("queries do not match the layout")
    q = q.contiguous()
    block_m = layout.block_m
    tiles = tiles or TileConfig.default(block_m, rank, q.dtype, layout.splits)
    dv = tiles.dv
    rows = tokens * heads
    req = layout.requests
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    rope_p2 = max(16, triton.next_power_of_2(rope))
    if layout.schedule is not None:
        return _scheduled(q, ckv, kr, layout, scale, tiles, precision, rope_p2)
    if layout.splits > 1:
        out = torch.empty(layout.splits, rows, rank, dtype=torch.float32, device=q.device)
        lse = torch.empty(layout.splits, rows, dtype=torch.float32, device=q.device)
    else:
        out, lse = torch.empty(rows, rank, dtype=q.dtype, device=q.device), q
    grid = (layout.block_req.numel(), layout.splits, rank // dv)
    _mla_kernel[grid](
        q, ckv, kr, out, lse, layout.kv_ckv, layout.kv_kr,
        layout.block_req, layout.block_row0, req[0], req[1], req[2], req[3],
        heads, scale * LOG2E, q.stride(1), ckv.stride(0),
        kr.stride(0), rows, RANK=rank, ROPE=rope, ROPE_P2=rope_p2,
        SPLIT=layout.splits > 1, BLOCK_M=block_m,
        BLOCK_N=tiles.block_n, DV=dv, PRECISION=precision, **pdl_args(q.device),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    if layout.splits > 1:
        out = merge_splits(out, lse, q.dtype, release=release and MERGE_RELEASES)
    return out.view(tokens, heads, rank)


def _scheduled(q: torch.Tensor, ckv: torch.Tensor, kr: torch.Tensor, layout: PagedLayout,
               scale: float, tiles: TileConfig, precision: str, rope_p2: int) -> torch.Tensor:
    """:func:`paged_mla_attention` over a scheduled layout: one program per piece (room for
    ``layout.programs``), then the merge of the blocks read in several pieces."""
    tokens, heads, _ = q.shape
    rank, rope = ckv.shape[1], kr.shape[1]
    block_m, room = layout.block_m, layout.programs
    if tiles.dv != rank:
        raise ValueError("a scheduled launch keeps every value column in one program")
    out = torch.empty(tokens * heads, rank, dtype=q.dtype, device=q.device)
    part = torch.empty(room * block_m, rank, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(room * block_m, dtype=torch.float32, device=q.device)
    blocks, req = layout.block_req.numel(), layout.requests
    tables = (layout.block_req, layout.block_row0, req[0], req[1], req[2], req[3])
    _mla_pieces_kernel[(room,)](
        q, ckv, kr, out, part, part_lse, layout.kv_ckv, layout.kv_kr, *tables, layout.schedule,
        blocks, heads, scale * LOG2E, q.stride(1), ckv.stride(0), kr.stride(0),
        RANK=rank, ROPE=rope, ROPE_P2=rope_p2, BLOCK_M=block_m, BLOCK_N=tiles.block_n,
        PRECISION=precision, **pdl_args(q.device), num_warps=tiles.num_warps,
        num_stages=tiles.num_stages)
    block_d = min(32, rank)
    # Rows per merge program: a launch of few blocks (a short forward, whose last token's block
    # is cut into up to a wave of pieces) merges row by row, so that one block's pieces are read
    # by many programs; many blocks (decode batches, a few pieces each) by whole blocks.
    rows = MERGE_ROWS if blocks <= MERGE_BY_ROW_UP_TO else block_m
    _merge_pieces_kernel[(blocks * (block_m // rows), rank // block_d)](
        part, part_lse, out, layout.schedule, *tables[:4], heads, room, blocks, RANK=rank,
        BLOCK_M=block_m, ROWS=rows, BLOCK_D=block_d, GROUP=8 * block_m // rows,
        **pdl_args(q.device), num_warps=4)
    return out.view(tokens, heads, rank)


def merge_splits(out: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype,
                 tiles: tuple[int, int, int] | None = None, *, release: bool = False
                 ) -> torch.Tensor:
    """The rows' outputs [rows, rank] in ``dtype`` from the key splits' partial outputs
    [splits, rows, rank] and base-2 log-sum-exps [splits, rows]: weights 2^(lse_s − max); a
    split of lse −inf (it saw no key) weighs 0 and its partial output is not read (the
    attention kernel does not write one), so splits past a short request's keys cost only
    their log-sum-exps. ``tiles``: (rows, columns, warps) per program, overriding the
    default (a benchmark's sweep). ``release``: let the next launch start once this one's
    programs have waited.

    One launch: in torch this was a softmax, a product, a sum and a cast — four kernels per
    layer, ~12 µs of a batch-1 decode step's ~160 µs per layer on an H200."""
    splits, rows, rank = out.shape
    merged = torch.empty(rows, rank, dtype=dtype, device=out.device)
    if rows == 0:
        return merged
    block_r, block_d, warps = tiles or merge_tiles(splits, rank)
    grid = (triton.cdiv(rows, block_r), triton.cdiv(rank, block_d))
    _merge_kernel[grid](out, lse, merged, rows, rank, SPLITS=splits,
                        S_P2=triton.next_power_of_2(splits), BLOCK_R=block_r, BLOCK_D=block_d,
                        RELEASE=release, **pdl_args(out.device), num_warps=warps)
    return merged


def merge_tiles(splits: int, rank: int) -> tuple[int, int, int]:
    """(rows, columns, warps) of a merge program. Every split's partials of a program's tile
    are read in one wide load (a chain of one load per split kept a batch-1 step's merge at
    ~7 µs a layer on an H200): many splits (short batches) take few rows and columns each, so
    there are enough programs to stream the partials; few splits, larger tiles."""
    if splits >= 32:
        return 1, 32, 4
    if splits >= 8:
        return 2, 64, 4
    return 8, min(64, triton.next_power_of_2(rank)), 2


@triton.jit(do_not_specialize=["rows"])
def _merge_kernel(OUT, LSE, DST, rows, rank, SPLITS: tl.constexpr, S_P2: tl.constexpr,
                  BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, RELEASE: tl.constexpr,
                  PDL: tl.constexpr):
    wait_for_previous(PDL)
    if RELEASE:
        release_next(PDL)
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    row_ok, d_ok = r < rows, d < rank
    s = tl.arange(0, S_P2)
    at = s[:, None] * rows + r[None, :]  # [S, R]
    seen = (s[:, None] < SPLITS) & row_ok[None, :]
    lse = tl.load(LSE + at, mask=seen, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # no split saw a key: weights all 0
    weight = tl.exp2(lse - top[None, :])
    total = tl.sum(weight, 0)
    # A split whose row saw no key (lse −inf) weighs nothing, and its partial output is not
    # read: a split past its request's keys never wrote one.
    seen = seen & (lse > float("-inf"))
    part = tl.load(OUT + at[:, :, None].to(tl.int64) * rank + d[None, None, :],
                   mask=seen[:, :, None] & d_ok[None, None, :], other=0.0)
    acc = tl.sum(part * weight[:, :, None], 0)
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(DST + r[:, None].to(tl.int64) * rank + d[None, :], out.to(DST.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])
