"""All-to-all expert dispatch: each token's rows travel to the ranks that hold its experts.

Under data-parallel attention (:func:`~.shard.shard_model` with ``attention="data"``) every rank
runs its own requests: its hidden states are its own tokens, not a replica of everyone's, so
the tensor-parallel MoE (every rank routes every token, computes its own experts' share, one
all-reduce) has nothing to all-reduce. Instead each rank routes its tokens and sends each
token–expert assignment's row to the rank holding that expert; each rank runs its experts over
the rows it received, from every rank, as one batch, and sends each output back to the rank
that owns the token, which sums its assignments' outputs with their routing weights.

Three exchanges a layer over the device group: the assignment counts (W integers per rank,
read back to the host to size the next two: not capturable in a CUDA graph), the rows out
(with their experts' ids), the outputs back. A rank with no tokens takes part with empty
tensors, since its peers' exchanges wait for it (:meth:`~irminsul.model.MLAModel.idle`).

Rounding: each expert's output is rounded to the activations' dtype once before it travels
back (a one-process MoE rounds only the weighted sum); in float32 the logits equal one
process's to float rounding, which the tests bound at 1e-5.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from .group import ParallelGroup, guarded

# compute(rows [R, D], expert ids [R] (the model's numbering, all of them this rank's)) ->
# each row's output through its expert [R, D], unweighted.
LocalExperts = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def dispatch(group: ParallelGroup, experts: int, x: torch.Tensor, weights: torch.Tensor,
             ids: torch.Tensor, compute: LocalExperts) -> torch.Tensor:
    """The routed experts' output [T, D] (x's dtype) for this rank's tokens ``x`` [T, D], routed
    to ``ids`` [T, k] with ``weights`` [T, k] (float32), ``experts`` routed experts in all,
    rank r holding experts ``r·E/W .. (r+1)·E/W − 1`` and running them with ``compute``. Every
    rank of ``group`` must call it for the same layer, T may differ between them (0 too)."""
    world = group.world_size
    per_rank = experts // world
    tokens, k = ids.shape
    flat = ids.reshape(-1).long()  # the router kernel's ids are int32
    owner = flat // per_rank
    order = owner.argsort(stable=True)  # assignments grouped by the rank that runs them
    sent = torch.zeros(world, dtype=torch.int64, device=x.device)
    sent.scatter_add_(0, owner, torch.ones_like(owner))
    received = torch.empty_like(sent)
    with guarded(group, "an expert dispatch"):
        dist.all_to_all_single(received, sent, group=group.device_group)
        send_splits, recv_splits = sent.tolist(), received.tolist()
        rows = x[order // k]
        in_rows = x.new_empty((sum(recv_splits), x.shape[1]))
        dist.all_to_all_single(in_rows, rows, recv_splits, send_splits,
                               group=group.device_group)
        in_ids = flat.new_empty(sum(recv_splits))
        dist.all_to_all_single(in_ids, flat[order].contiguous(), recv_splits, send_splits,
                               group=group.device_group)
        out_rows = compute(in_rows, in_ids).to(x.dtype).contiguous()
        back = x.new_empty((tokens * k, x.shape[1]))
        dist.all_to_all_single(back, out_rows, send_splits, recv_splits,
                               group=group.device_group)
    y = back.float() * weights.reshape(-1)[order, None]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    return out.index_add_(0, order // k, y).to(x.dtype)
