"""Greedy sampling's argmax over the vocabulary, for a batch of rows, in two launches.

``torch.argmax`` over a [B, 102400] logits tensor ran as one reduction kernel taking ~23 µs per
decode step on an H200 at batch 1 and 8 (profile of benchmarks/gpu/decode.py): a few programs
walking each row. Here the rows are cut into chunks, one program each, and a second launch
reduces each row's chunk winners — ~0.4 MB of float32 logits is then read by many SMs at once.

Same answer as ``torch.argmax(x, -1)``: the first index of the maximum; a NaN counts as larger
than any number, so a row with NaNs gives its first NaN's index. With ``finite``, the second
launch also says whether each row's maximum is a finite number (no NaN, no +inf, something
above -inf): a row that is not has no token to pick, and the flag comes back with the ids in
one read, so checking costs the host no launch and no sync of its own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import pdl_args, wait_for_previous

CHUNK = 4096  # vocabulary entries per program of the first launch (25 for DeepSeek's 102400)


@triton.jit
def _chunk_kernel(X, VAL, IDX, vocab, x_stride, chunks, CHUNK: tl.constexpr,
                  PDL: tl.constexpr):
    wait_for_previous(PDL)
    row, chunk = tl.program_id(0), tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    ok = cols < vocab
    x = tl.load(X + row.to(tl.int64) * x_stride + cols, mask=ok, other=float("-inf")).to(
        tl.float32)
    nan = (x != x) & ok
    first_nan = tl.min(tl.where(nan, cols, vocab), 0)
    best = tl.max(tl.where(nan, float("-inf"), x), 0)
    first_best = tl.min(tl.where(ok & (x == best), cols, vocab), 0)
    has_nan = first_nan < vocab
    # A chunk with a NaN reports it as its value (NaN) at its first NaN's index.
    tl.store(VAL + row * chunks + chunk, tl.where(has_nan, float("nan"), best))
    tl.store(IDX + row * chunks + chunk, tl.where(has_nan, first_nan, first_best))


@triton.jit
def _row_kernel(VAL, IDX, OUT, OK, chunks, vocab, C_P2: tl.constexpr, FINITE: tl.constexpr,
                PDL: tl.constexpr):
    wait_for_previous(PDL)
    row = tl.program_id(0)
    c = tl.arange(0, C_P2)
    ok = c < chunks
    val = tl.load(VAL + row * chunks + c, mask=ok, other=float("-inf"))
    idx = tl.load(IDX + row * chunks + c, mask=ok, other=vocab)
    nan = (val != val) & ok
    first_nan = tl.min(tl.where(nan, idx, vocab), 0)
    best = tl.max(tl.where(nan, float("-inf"), val), 0)
    # Chunks are in index order and each reports its own first best: the lowest index wins.
    first_best = tl.min(tl.where(ok & (val == best), idx, vocab), 0)
    tl.store(OUT + row, tl.where(first_nan < vocab, first_nan, first_best).to(tl.int64))
    if FINITE:  # |best| < inf is false for a +inf and for a row all -inf
        tl.store(OK + row, ((first_nan == vocab) & (tl.abs(best) < float("inf"))).to(tl.int64))


def argmax_rows(x: torch.Tensor, *, finite: bool = False) -> torch.Tensor:
    """``torch.argmax(x, -1)`` of x [B, V] (float, last dim contiguous) as int64 [B]. With
    ``finite``, int64 [2, B]: the ids, then 1 where the row's maximum is finite, else 0."""
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"argmax_rows takes float logits [B, V], got {x.dtype} {tuple(x.shape)}")
    rows, vocab = x.shape
    if vocab == 0 and rows:
        raise ValueError("argmax_rows: an empty vocabulary has no argmax")
    both = torch.empty(2 if finite else 1, rows, dtype=torch.int64, device=x.device)
    out = both if finite else both[0]
    if rows == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    chunks = triton.cdiv(vocab, CHUNK)
    val = torch.empty(rows, chunks, dtype=torch.float32, device=x.device)
    idx = torch.empty(rows, chunks, dtype=torch.int32, device=x.device)
    _chunk_kernel[(rows, chunks)](x, val, idx, vocab, x.stride(0), chunks, CHUNK=CHUNK,
                                  **pdl_args(x.device), num_warps=8)
    _row_kernel[(rows,)](val, idx, both[0], both[-1], chunks, vocab,
                         C_P2=max(2, triton.next_power_of_2(chunks)), FINITE=finite,
                         **pdl_args(x.device), num_warps=1)
    return out
