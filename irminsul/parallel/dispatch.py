"""All-to-all expert dispatch: each token's row travels once to each rank that holds one of its experts.

Under data-parallel attention (:func:`~.shard.shard_model` with ``attention="data"``) every rank
runs its own requests: its hidden states are its own tokens, not a replica of everyone's, so
the tensor-parallel MoE (every rank routes every token, computes its own experts' share, one
all-reduce) has nothing to all-reduce. Instead each rank routes its tokens and sends each token's
row once to every rank that holds one of its experts, with the (expert, weight) of each of its
assignments there; each rank runs its experts over the rows it received, from every rank, as one
batch, sums each row's weighted expert outputs, and sends that one row back to the token's rank,
which adds up its rows from the ranks. (As DeepEP does: under DeepSeek-V3's group-limited routing
at 8 ranks, its 8 groups one a rank, a token's 8 assignments reach at most 4 ranks, so at most
half the rows an assignment each would move.)

Four exchanges a layer over the device group: the counts (rows and assignments per rank pair,
read back to the host to size the next ones: not capturable in a CUDA graph), the rows out, the
assignments out (row, expert id, weight: one int64 tensor), the summed outputs back. A rank with
no tokens takes part with empty tensors, since its peers' exchanges wait for it
(:meth:`~irminsul.model.MLAModel.idle`).

Inside :func:`fixed_capacity` (a forward replayed from a CUDA graph: every rank's batch padded
to the same bucket of T tokens) the exchange has fixed sizes instead, as DeepEP's low-latency
mode has: every token's row goes to every rank with its k assignments there (another rank's
expert, or none: id −1, weight 0), three all-to-alls of equal splits ([W, T, D] rows, [W, T, 2k]
assignments, [W, T, D] outputs back) and nothing read back to the host. It moves up to W / (the
ranks a token reaches) times the rows the counted exchange does (≤ 2× at V3's 8 ranks, where a
token reaches at most 4), for a step with no host synchronisation; the experts run only the
assignments that are there.

Rounding: each rank's weighted sum over a token's experts there is rounded to the activations'
dtype once before it travels back (a one-process MoE rounds only the whole sum); in float32 the
logits equal one process's to float rounding, which the tests bound at 1e-5.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

import torch
import torch.distributed as dist

from .group import ParallelGroup, guarded

_fixed = contextvars.ContextVar("irminsul_fixed_capacity", default=False)


class HeldExperts(Protocol):
    """The routed experts this rank holds (:class:`~irminsul.model.MoE` under data-parallel
    attention), run over rows other ranks sent."""

    def local_experts(self, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each row [R, D] through its expert ``ids`` [R] (the model's numbering, all of them
        held here), unweighted: [R, D]."""

    def local_weighted(self, rows: torch.Tensor, weights: torch.Tensor,
                       ids: torch.Tensor) -> torch.Tensor:
        """Each row [R, D]'s weighted sum over its assignments ``ids`` / ``weights`` [R, k] to
        experts held here (any other id, −1 included, adds nothing): [R, D]."""


@contextmanager
def fixed_capacity() -> Iterator[None]:
    """Within it, :func:`dispatch` exchanges fixed sizes (the module's docstring): for forwards
    every rank pads to the same tokens — a CUDA graph's capture and replays."""
    token = _fixed.set(True)
    try:
        yield
    finally:
        _fixed.reset(token)


def dispatch(group: ParallelGroup, experts: int, x: torch.Tensor, weights: torch.Tensor,
             ids: torch.Tensor, held: HeldExperts) -> torch.Tensor:
    """The routed experts' output [T, D] (x's dtype) for this rank's tokens ``x`` [T, D], routed
    to ``ids`` [T, k] with ``weights`` [T, k] (float32), ``experts`` routed experts in all,
    rank r holding experts ``r·E/W .. (r+1)·E/W − 1`` and running them with ``held``. Every
    rank of ``group`` must call it for the same layer; T may differ between them (0 too), but
    not within :func:`fixed_capacity`, whose exchanges all have T tokens on every rank."""
    if _fixed.get():
        return _fixed_dispatch(group, experts, x, weights, ids, held)
    world, device = group.world_size, x.device
    tokens, k = ids.shape
    flat = ids.reshape(-1).long()  # the router kernel's ids are int32
    token = torch.arange(tokens, device=device).repeat_interleave(k)
    owner = flat // (experts // world)
    # The (rank, token) pairs: one row each, grouped by rank; ``pair`` maps each assignment
    # to its pair.
    pairs, pair = torch.unique(owner * tokens + token, return_inverse=True)
    pair_owner, pair_token = pairs // max(tokens, 1), pairs % max(tokens, 1)
    order = owner.argsort(stable=True)  # the assignments, grouped by rank
    sent = torch.zeros(world, 2, dtype=torch.int64, device=device)  # [rows, assignments]
    sent[:, 0].scatter_add_(0, pair_owner, torch.ones_like(pair_owner))
    sent[:, 1].scatter_add_(0, owner, torch.ones_like(owner))
    starts = sent[:, 0].cumsum(0) - sent[:, 0]  # each rank's first pair
    # Each assignment: its row among those sent to its rank, its expert, its weight's bits.
    meta = torch.stack([pair[order] - starts[owner[order]], flat[order],
                        weights.reshape(-1)[order].view(torch.int32).long()], 1)
    received = torch.empty_like(sent)
    with guarded(group, "an expert dispatch"):
        dist.all_to_all_single(received, sent, group=group.device_group)
        rows_out, rows_in = sent[:, 0].tolist(), received[:, 0].tolist()
        meta_out, meta_in = sent[:, 1].tolist(), received[:, 1].tolist()
        in_rows = x.new_empty((sum(rows_in), x.shape[1]))
        dist.all_to_all_single(in_rows, x[pair_token], rows_in, rows_out,
                               group=group.device_group)
        in_meta = meta.new_empty((sum(meta_in), 3))
        dist.all_to_all_single(in_meta, meta.contiguous(), meta_in, meta_out,
                               group=group.device_group)
        # Each received assignment's row: its sender's first row here plus its row there.
        first = torch.tensor(rows_in, dtype=torch.int64, device=device).cumsum(0) - torch.tensor(
            rows_in, dtype=torch.int64, device=device)
        sender = torch.repeat_interleave(torch.arange(world, device=device),
                                         torch.tensor(meta_in, device=device))
        row = first[sender] + in_meta[:, 0]
        weight = in_meta[:, 2].to(torch.int32).view(torch.float32)
        outputs = held.local_experts(in_rows[row], in_meta[:, 1]).float() * weight[:, None]
        summed = torch.zeros((len(in_rows), x.shape[1]), dtype=torch.float32, device=device)
        summed = summed.index_add_(0, row, outputs).to(x.dtype)
        back = x.new_empty((len(pairs), x.shape[1]))
        dist.all_to_all_single(back, summed, rows_out, rows_in, group=group.device_group)
    out = torch.zeros(x.shape, dtype=torch.float32, device=device)
    return out.index_add_(0, pair_token, back.float()).to(x.dtype)


def _fixed_dispatch(group: ParallelGroup, experts: int, x: torch.Tensor, weights: torch.Tensor,
                    ids: torch.Tensor, held: HeldExperts) -> torch.Tensor:
    """:func:`dispatch` in fixed sizes: every row to every rank, with its assignments there."""
    world, (tokens, k), dim = group.world_size, ids.shape, x.shape[1]
    ranks = torch.arange(world, device=x.device)[:, None, None]
    there = ids[None].long() // (experts // world) == ranks  # [W, T, k]
    meta = torch.cat([torch.where(there, ids[None].to(torch.int32), -1),
                      torch.where(there, weights[None].float(), 0.0).view(torch.int32)], 2)
    rows_in = x.new_empty((world, tokens, dim))
    meta_in = torch.empty_like(meta)
    with guarded(group, "an expert dispatch"):
        dist.all_to_all_single(rows_in, x[None].expand(world, tokens, dim).contiguous(),
                               group=group.device_group)
        dist.all_to_all_single(meta_in, meta, group=group.device_group)
        summed = held.local_weighted(rows_in.view(world * tokens, dim),
                                     meta_in[..., k:].reshape(-1, k).view(torch.float32),
                                     meta_in[..., :k].reshape(-1, k))
        back = torch.empty_like(summed)
        dist.all_to_all_single(back, summed.contiguous(), group=group.device_group)
    return back.view(world, tokens, dim).float().sum(0).to(x.dtype)
