"""CUDA graphs of the paged forward: a forward of short spans replayed in one call.

A forward of a few tokens — a decode step, a PIC prefill whose novel spans are short — costs far
more host time than device time: some sixty launches per layer. A graph captures
:meth:`MLAModel.hidden_paged` once per token count (a bucket) and replays it; a batch is padded
to its bucket and its inputs are copied into the static buffers the graph reads:

- token ids, positions and the new rows' c_KV / k_r slots, [bucket] each, and the batch rows
  whose logits are wanted;
- the attention kernel's layout at a fixed shape per bucket: blocks of query rows (buckets of up
  to 8 tokens, mostly decode steps, and where heads are fewer than 64 up to the kernel's
  ``SHORT_FORWARD`` (512) tokens, mostly short PIC prefills: 16 rows, one token's heads;
  larger ones, mostly prefill chunks: 64 rows, four tokens sharing each read of their keys),
  room for every block a batch of the
  bucket's tokens can need (one partial block per request at most), the division of the keys:
  for many 16-row blocks pieces written with each batch (each block's keys cut by their
  length, one program per piece), otherwise a fixed number of key splits per request sized
  for the bucket's blocks (the kernel divides each request's keys itself),
  key slot lists of any length up to ``max_keys``. Unused blocks name rows past their
  request's end and do nothing;
- the padding tokens as one more request whose keys and new rows are a scratch slot.

Only batches whose every span runs in the kernel qualify: short spans, and long ones (prefill
chunks) where the model runner routes them there; the engine runs the rest eagerly. Needs heads
divisible by 16 (DeepSeek-V2/V3: 16, 128).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import NamedTuple, TypeVar

import numpy as np
import torch

from ..kernels import PagedLayout
from ..kernels.mla_attention import in_pieces, key_splits, rows_per_block, scheduled_programs
from ..model import MLAModel
from ..model.paged import PagedKV
from .kv_pool import HANDLE_LOW, pack
from .staging import Staging

# Powers of two up to 256 (decode batches, short PIC spans); then steps of 128 tokens up to 1K
# and 256 up to 2K: prefill chunks of up to 2K tokens replay too (``ModelRunner`` says which),
# padded by at most 255 tokens.
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 384, 512, 640, 768, 896, 1024, 1280, 1536, 1792,
           2048)
DECODE_BUCKET = 8  # buckets up to this many tokens take one token's 16 heads per block
T = TypeVar("T")


def block_rows(bucket: int, heads: int) -> int:
    """Query rows per kernel block in a bucket's launch: 16 up to :data:`DECODE_BUCKET` tokens,
    else the eager launch's rule for a forward of the bucket's tokens
    (:func:`~irminsul.kernels.mla_attention.rows_per_block`: 16 for short forwards where heads
    are fewer than 64, else 64). A decode batch of more requests than ``SHORT_FORWARD`` fills
    a quarter of each 64-row block where heads are 16: batches that large are rare, and a graph
    of their own per bucket cost capture time and memory."""
    if bucket <= DECODE_BUCKET:
        return 16
    return rows_per_block(bucket, bucket, heads)


def whole_blocks(bucket: int, heads: int, rows: int) -> int:
    """Blocks of ``rows`` query rows holding a bucket's rows back to back."""
    return -(-bucket * heads // rows)


def block_room(bucket: int, heads: int, rows: int) -> int:
    """Blocks a batch of ``bucket`` tokens can need in blocks of ``rows``, padding request
    included: whole blocks of all its rows, plus one partial block per request."""
    return whole_blocks(bucket, heads, rows) + (0 if heads % rows == 0 else bucket + 1)


def launches(buckets: tuple[int, ...], heads: int) -> list[tuple[int, int]]:
    """(bucket, rows per block) of every graph: one per bucket."""
    return [(b, block_rows(b, heads)) for b in buckets]


def capture(run: Callable[[], T], pool: tuple[int, int] | None = None
            ) -> tuple[torch.cuda.CUDAGraph, T]:
    """A CUDA graph of ``run`` (in the memory ``pool``, if given) and what the captured call
    returned, which the graph's replays overwrite. ``run`` runs once on a side stream first:
    kernels compiled and libraries' per-stream state made, as capture requires."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = run()
    return graph, out


class Staged(NamedTuple):
    """A batch written into a host mirror but its token ids (:meth:`CudaGraphs.stage`)."""

    launch: tuple[int, int]  # (bucket, rows per block): the graph that replays it
    tokens: int  # its new tokens
    wanted: int  # the rows whose logits are wanted (0: all)
    keys: int  # key slots written per kind
    stamp: int  # which staging of the graphs' buffer it was: only the latest may replay


class CudaGraphs:
    """Captured forwards per bucket over one engine's pool, and the buffer they read.

    On a CUDA device every bucket is captured when the engine starts (about a forward's time
    each). Elsewhere there are no graphs: each bucket's padded, fixed-shape forward runs as it
    is, over the same buffer — the path a graph replays, checkable on a CPU.

    Every input lives in one int64 buffer (:class:`~.staging.Staging`), a bucket's arrays back
    to back in its own region so that two copies send a batch: ``[rows | last | blocks |
    requests | c_KV keys]`` up to the batch's keys, then its k_r keys.
    """

    def __init__(self, model: MLAModel, ckv: torch.Tensor, kr: torch.Tensor,
                 scratch: tuple[int, int], *, buckets: tuple[int, ...] = BUCKETS,
                 max_keys: int = 1 << 22) -> None:
        """``ckv``/``kr``: the pool; ``scratch``: the pool's reserved (c_KV, k_r) slot pair for the
        padding rows; ``max_keys``: room for the key slot lists of one batch."""
        heads = model.config.num_attention_heads
        if heads % 16:
            raise ValueError(f"CUDA graphs need heads divisible by 16, got {heads}")
        self.model, self.ckv, self.kr, self.scratch = model, ckv, kr, scratch
        self.heads, self.buckets, self.max_keys = heads, buckets, max_keys
        top, device = buckets[-1], ckv.device
        self.cuda = device.type == "cuda"
        # Regions: ids, positions and new c_KV / k_r slots [4, bucket]; each request's last
        # row [bucket + 1]; blocks [2, room]; the request table [4, bucket + 1]; the pieces
        # of 16-row launches (PagedLayout.plan); keys.
        self.launches = launches(buckets, heads)
        self.programs = scheduled_programs(device)
        room = max(block_room(top, heads, rows) for _, rows in self.launches)
        sizes = (4 * top, top + 1, 2 * room, 4 * (top + 1), self._plan_size(room), max_keys)
        self._at = np.cumsum((0,) + sizes).tolist()  # region starts, then the k_r keys'
        self.inputs = Staging(device, self._at[-1] + max_keys)
        # (bucket, rows per block) -> replay
        self.forwards: dict[tuple[int, int], Callable[[], torch.Tensor]] = {}
        # (bucket, rows per block) -> forwards served through that graph
        self.replays: Counter[tuple[int, int]] = Counter()
        self._stamp = 0  # stagings of the buffer so far
        self.pool = torch.cuda.graph_pool_handle() if self.cuda else None
        for launch in sorted(self.launches, reverse=True):  # largest first: the smaller reuse
            self.forwards[launch] = self._capture(*launch)  # its memory

    def fits(self, tokens: int, keys: int) -> bool:
        """Whether a batch of ``tokens`` new tokens with ``keys`` key slots in all fits."""
        return tokens <= self.buckets[-1] and keys + self.buckets[-1] <= self.max_keys

    def bucket(self, tokens: int) -> int:
        """The bucket a batch of ``tokens`` new tokens replays in: the least that holds it."""
        return next(b for b in self.buckets if b >= tokens)

    def stage(self, positions: np.ndarray, new_ckv: np.ndarray, new_kr: np.ndarray,
              spans: list[tuple[int, np.ndarray]], last: np.ndarray | None,
              bucket: int | None = None) -> Staged:
        """Write a batch's inputs but its token ids into the next host mirror, sending
        nothing: ``spans`` (new tokens, and the pool handles of every key, its own rows last)
        in batch order, as the kernel takes them; ``last`` the batch rows whose logits are
        wanted (None: all). The bulk of a replay's host work, which can run while the device
        still computes the forward that samples those tokens. :meth:`replay` must come next.
        ``bucket``: replay in this bucket, not the least that holds the batch (ranks whose
        graphs exchange rows pad to the same one); a batch of no tokens is padding only."""
        n = len(positions)
        least = self.bucket(n)
        if bucket is None:
            bucket = least
        elif bucket not in self.buckets or bucket < least:
            raise ValueError(f"a batch of {n} tokens does not replay in bucket {bucket}")
        launch = (bucket, block_rows(bucket, self.heads))
        last = np.zeros(0, dtype=np.int64) if last is None else last
        keys = self._fill(*launch, positions, new_ckv, new_kr, spans, last)
        self._stamp += 1
        return Staged(launch, n, len(last), keys, self._stamp)

    def replay(self, staged: Staged, tokens: np.ndarray | torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The last layer's hidden states [T, D] of a batch :meth:`stage` wrote, and its
        wanted rows on the device (None: all): its token ids written, the inputs sent, the
        bucket's graph replayed. Token ids on the device (int64) are copied in on the device
        after the inputs are sent, so the host never waits for them. The result lives in graph
        memory the buckets share: read it before the next call."""
        if staged.stamp != self._stamp:
            raise ValueError("a staged batch was written over by a later one")
        if len(tokens) != staged.tokens:
            raise ValueError(f"{len(tokens)} token ids for a batch of {staged.tokens}")
        on_device = isinstance(tokens, torch.Tensor)
        if not on_device:
            self._views(self.inputs.host(), *staged.launch)[0][0, :staged.tokens] = tokens
        self.inputs.send((0, self._at[5] + staged.keys), (self._at[6], self._at[6] + staged.keys))
        if on_device:
            self._views(self.inputs.buffer, *staged.launch)[0][0, :staged.tokens].copy_(tokens)
        self.replays[staged.launch] += 1
        wanted = (self._views(self.inputs.buffer, *staged.launch)[1][:staged.wanted]
                  if staged.wanted else None)
        return self.forwards[staged.launch]()[:staged.tokens], wanted

    def splits(self, tokens: int) -> int:
        """Key splits per request in the launch that replays a batch of ``tokens`` tokens: one
        program walks each request's keys / splits, so a request with many more keys than
        the others sets the launch's time. 0 where the launch cuts each block's keys into
        pieces by their length (a long request spread over many programs)."""
        bucket = self.bucket(tokens)
        return self._splits(bucket, block_rows(bucket, self.heads))

    def _splits(self, bucket: int, block_m: int) -> int:
        """A launch's key splits per request; 0: in pieces."""
        if in_pieces(block_m, block_room(bucket, self.heads, block_m)):
            return 0
        return key_splits(whole_blocks(bucket, self.heads, block_m), block_m, self.ckv.device)

    def _plan_size(self, room: int) -> int:
        """Entries of the pieces' table of a 16-row launch with ``room`` blocks: pieces for
        ``programs`` programs plus one per block at most (:meth:`PagedLayout.plan`)."""
        return 1 + 3 * (self.programs + room) + 2 * room

    def _views(self, buffer: np.ndarray | torch.Tensor, bucket: int, rows: int) -> tuple:
        """A launch's regions of the buffer (or of a host mirror): rows [4, bucket], last rows
        [bucket + 1], blocks [2, room], request table [4, bucket + 1], schedule, c_KV keys, k_r
        keys."""
        at, room = self._at, block_room(bucket, self.heads, rows)
        return (buffer[:4 * bucket].reshape(4, bucket), buffer[at[1]:at[2]],
                buffer[at[2]:at[2] + 2 * room].reshape(2, room),
                buffer[at[3]:at[3] + 4 * (bucket + 1)].reshape(4, bucket + 1),
                buffer[at[4]:at[4] + self._plan_size(room)], buffer[at[5]:at[6]],
                buffer[at[6]:])

    def _fill(self, bucket: int, block_m: int, positions: np.ndarray,
              new_ckv: np.ndarray, new_kr: np.ndarray, spans: list[tuple[int, np.ndarray]],
              last: np.ndarray) -> int:
        """Write a batch, padded to ``bucket`` tokens, into the next host mirror (the buffer
        itself off a GPU) but its token ids; returns the keys written, for the two copies that
        send it, ordered after the replay that read the buffer last."""
        n = len(positions)
        pad = bucket - n
        scratch_c, scratch_r = self.scratch
        new = [count for count, _ in spans] + ([pad] if pad else [])
        handles = [h for _, h in spans] + ([np.full(pad, pack(scratch_c, scratch_r))]
                                           if pad else [])
        rows, wanted, blocks, table, schedule, keys_c, keys_r = self._views(
            self.inputs.host(), bucket, block_m)
        # Every value a replay reads is written: a mirror holds an older batch's values.
        rows[1, :n], rows[2, :n], rows[3, :n] = positions, new_ckv, new_kr
        rows[:, n:] = np.array([0, 0, scratch_c, scratch_r])[:, None]  # padding: token 0 at 0
        wanted[:len(last)] = last
        # Unused blocks: the last request, from a row past every request's rows.
        used = PagedLayout.blocks(new, self.heads, block_m)
        blocks[0], blocks[1] = len(new) - 1, bucket * self.heads
        blocks[0, :used[0].size], blocks[1, :used[1].size] = used
        lengths = [len(h) for h in handles]
        table[:, :len(new)] = PagedLayout.request_table(new, lengths)[:, :len(new)]
        if in_pieces(block_m, blocks.shape[1]):  # unused blocks read no keys
            work = np.zeros(blocks.shape[1], dtype=np.int64)
            work[:used[0].size] = PagedLayout.block_work(new, lengths, self.heads, *used, block_m)
            schedule[:] = PagedLayout.plan(work, self.programs, room=self.programs + work.size)
        # Each request's handles unpacked straight into the buffer: no slot arrays in between.
        at = 0
        for h, length in zip(handles, lengths):
            np.right_shift(h, 32, out=keys_c[at:at + length])
            np.bitwise_and(h, HANDLE_LOW, out=keys_r[at:at + length])
            at += length
        return at

    def _capture(self, bucket: int, block_m: int) -> Callable[[], torch.Tensor]:
        """A launch's forward over the buffer: on CUDA a graph's replay, captured after a run
        of a batch of padding only (kernels compiled, libraries' per-stream state made, as
        capture requires); elsewhere the forward itself."""
        # Launches of many 16-row blocks are cut into pieces (the pieces are written with each
        # batch); the others split each request's keys, as many splits
        # as the launch's whole blocks call for whatever the lengths (the eager launch also
        # caps them by the longest request; here only key_splits' own cap holds: 128 per
        # request for 16-row blocks, 64 for 64-row ones).
        rows, _, blocks, table, schedule, keys_c, keys_r = self._views(self.inputs.buffer,
                                                                       bucket, block_m)
        splits = self._splits(bucket, block_m)
        if not splits:
            layout = PagedLayout(keys_c, keys_r, table, blocks[0], blocks[1], bucket,
                                 self.heads, block_m, 1, schedule,
                                 self.programs + blocks.shape[1])
        else:
            layout = PagedLayout(keys_c, keys_r, table, blocks[0], blocks[1], bucket,
                                 self.heads, block_m, splits)
        kv = PagedKV(self.ckv, self.kr, rows[2], rows[3], layout, None, [])

        def forward() -> torch.Tensor:
            return self.model.hidden_paged(rows[0], rows[1], kv)

        if not self.cuda:
            return forward
        empty = np.zeros(0, dtype=np.int64)
        keys = self._fill(bucket, block_m, empty, empty, empty, [], empty)
        self.inputs.send((0, self._at[5] + keys), (self._at[6], self._at[6] + keys))
        graph, out = capture(forward, self.pool)

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay
