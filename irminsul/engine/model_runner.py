"""The model runner: one forward over the KV pool's rows per batch, and the δ-rotation of reuses.

It owns the model, the pool's row tensors, the kernels' choice, the CUDA graphs and the rotation,
and knows nothing of plans, sequences or slot accounting: the cache manager names every slot
(:mod:`.batch`), the runner moves rows. It is the unit one GPU runs.

A batch is a list of contiguous spans, each attending to its sequence's rows up to its last
position. On CUDA short spans run in the paged Triton kernel, which reads the pool in place, and
a batch of them only replays a CUDA graph (:mod:`.graphs`); so does a batch with long spans
(fresh prefills among them) while it fits a graph's bucket and their attention is cheap enough
in the kernel (``GRAPH_PAIRS``): an eager forward's host time is what it saves. Other long spans
and everything off the GPU run in plain torch over context gathered from the pool.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, NamedTuple, Protocol

import numpy as np
import torch

from ..device import upload
from ..model import MLAModel
from ..model.mla import naive_from
from ..model.model import use_kernels
from ..model.paged import MaskedSpans, PagedKV
from .batch import ForwardBatch, Reuse
from .kv_pool import unpack
from .repair import LatentCheck, SignedCheck

if TYPE_CHECKING:
    from .graphs import CudaGraphs, Staged
    from .rotation import Rotation


# An item split into spans attends in one masked call when its keys are at most this many: the
# mask is [new tokens, keys] and the attention cannot skip masked blocks.
MERGED_MAX_KEYS = 8192
# Where there are graphs, a batch of long spans too runs in the kernel, replayed from a graph,
# while their attention's (query row, visible key) pairs are at most this many. An eager
# forward costs ~30 ms more host time than device time on an H200's host (V2-Lite, ~60 torch
# launches per layer: a 1K-token prefill took 51-62 ms against 24 ms of device time); the
# kernel's absorbed form spends (rank + rope + rank) multiply-adds per pair at ~47 TFLOP/s on
# prefill blocks (benchmarks/gpu/attention_kernels.py), ~20 ns per pair over 27 layers: ~1.5M pairs of
# 16 heads (a 1K-token fresh prefill is 8.4M row-key pairs, a 2K one 34M) cost that much.
GRAPH_PAIRS = 24_000_000
# ...and while no program of the graph's launch walks more than this many keys. A launch that
# splits each request's keys evenly (64-row blocks: batches past 512 tokens, one split a request
# past 1K) gives a request with many more keys than the others one program: the question of a
# new 2K-token header, alone at 16,384 keys, took the kernel 3.7 ms a layer on an H100, 101 of
# the forward's 132 ms (the eager forward of the same tokens: ~60 ms, the question in a launch
# of its own split 128 ways). At that rate 4,096 keys a program cost some 25 ms over 27 layers,
# about what the eager forward's host time costs.
GRAPH_SPLIT_KEYS = 4096


def default_kernels(model: MLAModel) -> bool:
    """Whether a runner runs the Triton kernels by default: on a CUDA device with triton."""
    return (model.lm_head.weight.device.type == "cuda"
            and importlib.util.find_spec("triton") is not None)


def default_graphs(model: MLAModel, kernels: bool) -> bool:
    """Whether a runner replays CUDA graphs by default: with the kernels on CUDA, for bfloat16
    models (grouped GEMM in float32 reads expert offsets on the host) whose attention heads fill
    16-row blocks."""
    weight = model.lm_head.weight
    return (kernels and weight.device.type == "cuda" and weight.dtype == torch.bfloat16
            and model.config.num_attention_heads % 16 == 0)


def resolve_backend(model: MLAModel, kernels: bool | None, graphs: bool | None
                    ) -> tuple[bool, bool]:
    """(kernels, graphs) for a model: the config's choices, their defaults where None."""
    kernels = default_kernels(model) if kernels is None else kernels
    graphs = default_graphs(model, kernels) if graphs is None else graphs
    if graphs and not kernels:
        raise ValueError("graphs replay the kernel path: they need kernels=True")
    weight = model.lm_head.weight
    if graphs and weight.device.type == "cuda" and weight.dtype != torch.bfloat16:
        raise ValueError(f"CUDA graphs need a bfloat16 model, not {weight.dtype}: grouped GEMM "
                         "in other dtypes reads the expert offsets on the host")
    return kernels, graphs


class StagedForward(NamedTuple):
    """A batch's graph inputs written ahead of its token ids (:meth:`ModelRunner.stage`)."""

    graph: Staged
    lengths: list[int]


class Peers(Protocol):
    """The other ranks whose engines run their model calls in lockstep with this one's
    (data-parallel attention: :class:`~irminsul.parallel.lockstep.LockstepRunner`). An engine
    with peers takes a turn whenever it has nothing to run, so that their steps can run."""

    @property
    def stopped(self) -> bool:
        """A rank announced its stop: no further step runs on any rank."""

    @property
    def turns(self) -> int:
        """The turns this rank has taken (steps it ran or joined, idle turns)."""

    def idle(self, stop: bool = False) -> bool:
        """This rank's turn with nothing to run (``stop``: and announce this rank's stop);
        whether any rank ran a step in it."""


class ModelRunner:
    """Runs forwards and rotations over one pool's rows ``ckv`` / ``kr`` [layers, slots, ·]."""

    # Whether its model calls run in lockstep with other ranks' engines (it is then a Peers).
    lockstep = False
    # Whether a graphed batch may be staged ahead of its token ids and replayed later (stage,
    # replay): not where each forward is one message to other ranks.
    stages_ahead = True

    def __init__(self, model: MLAModel, ckv: torch.Tensor, kr: torch.Tensor, *, kernels: bool,
                 graphs: bool, rotation: bool, scratch: tuple[int, int] | None = None,
                 check_layer: int | None = None, check_rule: str = "deviation") -> None:
        """``kernels`` / ``graphs``: as :func:`resolve_backend` gives them; ``rotation``: make
        the captured rotation (only live engines reuse rows); ``scratch``: a (c_KV, k_r) slot
        pair outside the cache's capacity that graphs write their padding rows to;
        ``check_layer``: the layer of CacheBlend-style repair's check forward
        (:meth:`check_latent`), None without that repair; ``check_rule``: how it scores
        reused tokens (``CacheConfig.recompute_rule``)."""
        self.model, self.ckv, self.kr, self.kernels = model, ckv, kr, kernels
        self._latent_check: LatentCheck | SignedCheck | None = None
        if check_layer is not None:
            check = SignedCheck if check_rule == "signed" else LatentCheck
            self._latent_check = check(model, ckv, check_layer)
        use_kernels(model, kernels)  # fused experts, router, latent store, add + norm
        if kernels and ckv.is_cuda:
            # Every variant of the attention kernels compiled now: a variant first met by a
            # request (a split count, 64-row blocks) compiled on its first token's clock.
            from ..kernels.mla_attention import compile_variants  # needs triton

            attention = model.model.layers[0].self_attn
            compile_variants(ckv[0], kr[0], attention.heads, attention.scale)
        self._naive_from = naive_from(model.config)
        self._rotation: Rotation | None = None
        if kernels and rotation:
            from .rotation import Rotation  # needs triton

            # A reuse rotates at most a prompt's worth of rows.
            self._rotation = Rotation(kr, model.rotary, model.config.max_position_embeddings)
        self.graphs: CudaGraphs | None = None
        if graphs:
            from .graphs import CudaGraphs  # needs triton

            if scratch is None:
                raise ValueError("graphs need a scratch slot pair for their padding rows")
            self.graphs = CudaGraphs(model, ckv, kr, scratch)

    @property
    def graph_replays(self) -> int:
        """Forwards served by replaying a CUDA graph so far."""
        return sum(self.graphs.replays.values()) if self.graphs is not None else 0

    def close(self) -> None:
        """Release what this runner holds outside this process: nothing here (a leader's runner
        releases its followers' copies, irminsul.parallel.leader)."""

    def rotate(self, reuse: Reuse) -> None:
        """The device work of a reuse: k_r slots ``dst`` of every layer := slots ``src`` rotated
        by ``deltas`` (queued on the current stream, ahead of the forward that reads them)."""
        if self._rotation is not None:
            self._rotation(*reuse)
            return
        src, dst, deltas = reuse
        device = self.kr.device
        base = self.kr[:, upload(src, device)].transpose(0, 1)  # [tokens, layers, rope]
        rotated = self.model.rotary.rotate(base, torch.from_numpy(deltas))
        self.kr[:, upload(dst, device)] = rotated.transpose(0, 1)

    def write_rows(self, handles: np.ndarray, ckv: torch.Tensor, kr: torch.Tensor) -> None:
        """Rows made elsewhere (the shared store's) written into the slot pairs ``handles``, one
        per token: ``ckv`` [layers, tokens, rank] and ``kr`` [layers, tokens, rope] (the k_r
        base, as at its source position), on any device, in any float dtype."""
        ckv_slots, kr_slots = (upload(s, self.ckv.device) for s in unpack(handles))
        self.ckv[:, ckv_slots] = ckv.to(device=self.ckv.device, dtype=self.ckv.dtype)
        self.kr[:, kr_slots] = kr.to(device=self.kr.device, dtype=self.kr.dtype)

    def recompute(self, prompt: np.ndarray) -> torch.Tensor:
        """The logits [vocab] after ``prompt`` computed from scratch, outside the pool (the
        live-PIC audit's reference): reads and writes no row of the pool."""
        return self.model.last_logits(torch.from_numpy(np.asarray(prompt, dtype=np.int64)))

    def check_latent(self, prompt: np.ndarray, positions: np.ndarray,
                     ckv_slots: np.ndarray) -> np.ndarray:
        """CacheBlend-style repair's check forward (:class:`~.repair.LatentCheck`): each reused
        position's distance between its fresh c_KV at the check layer and the cached row at
        ``ckv_slots``. Reads the pool, writes nothing."""
        if self._latent_check is None:
            raise ValueError("this runner was built without a check layer (no recompute_share)")
        return self._latent_check(prompt, positions, ckv_slots)

    @property
    def check_depth(self) -> int:
        """The layers :meth:`check_latent`'s forward runs whole (0 .. depth − 1); 0 without a
        check."""
        return 0 if self._latent_check is None else self._latent_check.depth

    def _replays_whole(self, batch: ForwardBatch, item_spans: list[tuple[np.ndarray, ...]]
                       ) -> bool:
        """Whether a batch whose spans are not all short runs whole in the kernel, from a graph:
        its tokens fit a bucket, the attention the graph moves into the kernel is at most
        GRAPH_PAIRS (query row, visible key) pairs — its long spans', and its short spans' that
        the eager route would attend in one masked call (:meth:`_merging`) instead of the
        kernel; other short spans run in the kernel either way — and no program of the launch
        walks more than GRAPH_SPLIT_KEYS keys."""
        if self.graphs is None or batch.tokens.size > self.graphs.buckets[-1]:
            return False
        pairs, long_spans = 0, False
        for at, spans in zip(batch.positions, item_spans):
            merging = self._merging(at, spans) if len(spans) > 1 else 0  # decode items: one span
            for i, rows in enumerate(spans):
                n = len(rows)
                if n >= self._naive_from:
                    long_spans = True
                if n >= self._naive_from or i < merging:
                    pairs += n * (int(at[rows[0]]) + (n + 1) // 2)
        heads = self.model.config.num_attention_heads
        if not long_spans or pairs * heads > GRAPH_PAIRS:
            return False
        splits = self.graphs.splits(batch.tokens.size)
        keys = max(int(at[-1]) for at in batch.positions) + 1  # the longest request's
        return not splits or keys <= GRAPH_SPLIT_KEYS * splits

    def _merging(self, at: np.ndarray, spans: tuple[np.ndarray, ...]) -> int:
        """How many of an item's leading spans the eager route attends in one masked call (0:
        none). Reused runs between computed ones split a prefill into spans, each an attention
        call of its own per layer (a dozen host ops each); one call over all the item's rows up
        to the last position of the spans that end below MERGED_MAX_KEYS, masked by position,
        costs one. Spans past it (a prompt's tail after a long reused body) attend on their
        own: the mask would cover every key up to them. With the kernel, only where a long span
        is among them: short spans alone attend in one kernel launch anyway."""
        early = 0
        while early < len(spans) and int(at[spans[early][-1]]) < MERGED_MAX_KEYS:
            early += 1
        if early > 1 and (not self.kernels
                          or max(len(rows) for rows in spans[:early]) >= self._naive_from):
            return early
        return 0

    def forward(self, batch: ForwardBatch, *, all_logits: bool = False) -> list[torch.Tensor]:
        """Each item's logits: [n, vocab] with ``all_logits``, else [1, vocab] for its last
        token. Every new token's latent rows are stored in its slot, layer by layer, before it
        attends; spans of one item see each other's rows within the forward.

        The batch splits into contiguous spans: short ones through the kernel when there is one
        (one launch per layer for all of them, context or not), the rest in torch over context
        gathered from the pool. A batch of kernel spans only replays a graph where there are
        graphs."""
        kernel, gathered, merged = self._route(batch)
        last = None if all_logits else np.cumsum(batch.lengths) - 1
        if self._graphed(batch, kernel, gathered, merged):
            return self.replay(self._stage(batch, kernel, last), batch.tokens)
        return self._eager(batch, kernel, gathered, merged, last)

    def stage(self, batch: ForwardBatch) -> StagedForward | None:
        """A batch's graph inputs but its token ids written ahead (its last token's logits
        wanted), for :meth:`replay`; None where the batch would not replay a graph. Nothing
        may run through the graphs between the two."""
        kernel, gathered, merged = self._route(batch)
        if not self._graphed(batch, kernel, gathered, merged):
            return None
        return self._stage(batch, kernel, np.cumsum(batch.lengths) - 1)

    def replay(self, staged: StagedForward, tokens: np.ndarray | torch.Tensor
               ) -> list[torch.Tensor]:
        """The logits of a batch :meth:`stage` wrote, given its token ids (host or device)."""
        hidden, rows = self.graphs.replay(staged.graph, tokens)
        return self.model.head(hidden, staged.lengths, rows)

    def _graphed(self, batch: ForwardBatch, kernel: list, gathered: list, merged: list) -> bool:
        return (self.graphs is not None and not gathered and not merged
                and self.graphs.fits(batch.tokens.size, sum(len(h) for _, _, h in kernel)))

    def _stage(self, batch: ForwardBatch, kernel: list, last: np.ndarray | None,
               bucket: int | None = None) -> StagedForward:
        new_ckv, new_kr = unpack(batch.new)
        graph = self.graphs.stage(np.concatenate(batch.positions), new_ckv, new_kr,
                                  [(n, h) for _, n, h in kernel], last, bucket)
        return StagedForward(graph, batch.lengths)

    def _route(self, batch: ForwardBatch) -> tuple[list, list, list]:
        """The batch's spans by where they attend: (kernel: batch rows, new tokens, key
        handles), (gathered: batch rows, context handles), (merged: batch rows, positions, key
        handles of positions 0..last)."""
        kernel, gathered, merged, offset = [], [], [], 0
        # A decode step is one span of one token: skip looking for breaks in it.
        item_spans = [(np.arange(1),) if len(at) == 1 else
                      np.split(np.arange(len(at)), np.flatnonzero(np.diff(at) != 1) + 1)
                      for at in batch.positions]
        whole = self._replays_whole(batch, item_spans)
        for at, seq_keys, spans in zip(batch.positions, batch.keys, item_spans):
            if whole:  # every span in the kernel, the batch replayed from a graph
                for rows in spans:
                    first, n = int(at[rows[0]]), len(rows)
                    kernel.append((rows + offset, n, seq_keys[:first + n]))
                offset += len(at)
                continue
            early = self._merging(at, spans)
            if early:
                rows = np.concatenate(spans[:early])
                merged.append((rows + offset, at[rows], seq_keys[:int(at[rows[-1]]) + 1]))
                spans = spans[early:]
            for rows in spans:
                first, n = int(at[rows[0]]), len(rows)  # one span: n positions from first
                span = slice(offset + int(rows[0]), offset + int(rows[0]) + n)
                if self.kernels and n < self._naive_from:
                    kernel.append((rows + offset, n, seq_keys[:first + n]))
                else:
                    gathered.append((span, seq_keys[:first]))
            offset += len(at)
        return kernel, gathered, merged

    def _eager(self, batch: ForwardBatch, kernel: list, gathered: list, merged: list,
               last: np.ndarray | None) -> list[torch.Tensor]:
        """The forward launched op by op: kernel spans in one launch per layer, the others in
        torch over their context gathered from the pool."""
        device = self.ckv.device
        lengths = batch.lengths
        at = np.concatenate(batch.positions)
        new_ckv, new_kr = unpack(batch.new)
        layout = None
        if kernel:
            from ..kernels import PagedLayout  # needs triton: only with kernels

            keys = [unpack(h) for _, _, h in kernel]
            layout = PagedLayout.build([n for _, n, _ in kernel], [c for c, _ in keys],
                                       [r for _, r in keys],
                                       self.model.config.num_attention_heads, device)
        take = (upload(np.concatenate([rows for rows, _, _ in kernel]), device)
                if kernel and (gathered or merged) else None)
        context = []
        for span, handles in gathered:
            slots = [upload(s, device) for s in unpack(handles)] if handles.size else [None, None]
            context.append((span, *slots))
        masked = [MaskedSpans(upload(rows, device), upload(at, device),
                              *(upload(s, device) for s in unpack(handles)))
                  for rows, at, handles in merged]
        kv = PagedKV(self.ckv, self.kr, upload(new_ckv, device), upload(new_kr, device), layout,
                     take, context, masked)
        hidden = self.model.hidden_paged(upload(batch.tokens, device), upload(at, device), kv)
        return self.model.head(hidden, lengths, None if last is None else upload(last, device))
