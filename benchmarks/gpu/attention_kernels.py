"""The attention and rotation kernels at DeepSeek-V2-Lite's attention shapes (16 heads, 512 + 64).

The attention kernel against the plain-torch path, and the rotation kernel that materialises a
reuse's k_r rows.

Per context length, one layer, median of repeats (each the device time per call of back-to-back
calls, `common.per_call`):

    decode     8 requests × 1 new token: torch (gather the rows, SDPA over head-folded queries)
               vs the kernel reading the pool in place, k_r materialised (rotated copies)
    prefill    one 512-token novel segment attending to the whole context, torch vs kernel (and a few
               other tile shapes for the kernel)
    spans      a PIC prefill's novel spans (a 30-token line and the last token) against the whole
               context, at the launch shapes a CUDA graph could fix (rows per block, key splits)
    line       agent_meta's forward as the engine runs it: a 31-token request line at position 50
               (its keys, the 50 before it and itself) and the last token (every key), at the
               32-token graph's launch (64-row blocks, 33 splits) and with 16-row blocks; and the
               split merge alone, which every launch with splits ends with
    rotation   what the materialisation costs once per reuse (gather–rotate–scatter of every
               k_r row, every layer) at a few launch shapes (tokens and layers per program, warps)

Rotating k_r on load inside the attention kernel instead was measured and dropped:
slower per read than materialised rows, which every decode step reads again (the "kernel fused"
rows of docs/results/gpu-kernels.json).

Prints a table and writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F
from common import V2_LITE, per_call, percentiles, run_metadata
from triton.runtime.errors import OutOfResources

from irminsul.kernels import PagedLayout, TileConfig, paged_mla_attention, rotate_kr
from irminsul.kernels.mla_attention import merge_splits
from irminsul.model import parse_config
from irminsul.model.rope import Rotary, softmax_scale

HEADS, RANK, ROPE = 16, 512, 64
PREFILL_TILES = [(16, TileConfig(64, 512, 4, 2)), (32, TileConfig(32, 512, 8, 2)),
                 (64, TileConfig(32, 256, 4, 2)), (64, TileConfig(32, 256, 8, 2))]
# (rows per block, key splits) for a 32-token bucket: 16-row blocks with splits for two waves of
# their 32 blocks (the graphs' first launch), 64-row blocks with those splits, and 64-row blocks
# with splits for two waves of their 8 (the graphs' launch now).
GRAPH_LAUNCHES = [(16, 9), (64, 9), (64, 33)]
LINE_LAUNCHES = [(64, 33), (16, 33)]  # the 32-token graph's launch, and 16-row blocks
ROTATE_SHAPES = [(64, 4, 4), (32, 4, 4), (64, 9, 4), (128, 3, 8), (32, 27, 4), (16, 9, 2)]


def torch_attention(q: torch.Tensor, ckv: torch.Tensor, kr: torch.Tensor, ckv_idx: list,
                    kr_idx: list, new: list[int], scale: float) -> torch.Tensor:
    """The engine's plain-torch path: gather each request's rows, one SDPA per request."""
    outs, t0 = [], 0
    for c, r, n in zip(ckv_idx, kr_idx, new):
        keys = torch.cat([ckv[c], kr[r]], dim=-1)
        mask = torch.ones(n, keys.shape[0], dtype=torch.bool, device=q.device).tril(
            keys.shape[0] - n).repeat(HEADS, 1)
        folded = q[t0:t0 + n].transpose(0, 1).reshape(1, 1, HEADS * n, -1)
        out = F.scaled_dot_product_attention(folded, keys[None, None], ckv[c][None, None],
                                             attn_mask=mask, scale=scale)
        outs.append(out.view(HEADS, n, RANK).transpose(0, 1))
        t0 += n
    return torch.cat(outs)


def measure(context: int, repeats: int) -> dict:
    rotary = Rotary(parse_config(V2_LITE))
    scale = softmax_scale(parse_config(V2_LITE))
    batch, room = 8, 600  # requests, slots for each request's new tokens
    slots, device = context + batch * room + batch * (context + room), "cuda"
    rotary_args = rotary.kernel_args(device)
    gen = torch.Generator(device=device).manual_seed(0)
    ckv = torch.randn(slots, RANK, device=device, generator=gen).bfloat16()
    kr = torch.randn(1, slots, ROPE, device=device, generator=gen).bfloat16()
    rng = np.random.default_rng(0)
    row = {"context": context}

    def run(label: str, fn) -> None:
        try:
            fn()
        except OutOfResources as err:  # a tile shape this GPU cannot hold: report, go on
            row[label] = str(err)
            return
        row[label] = percentiles([per_call(device, fn).device for _ in range(repeats)], 1e3)

    phases = (("decode", [1] * batch, [context] * batch), ("prefill", [512], [context]),
              ("line", [31, 1], [50, context]), ("spans", [30, 1], [context] * 2))
    # new tokens and the keys before them, per request; the rotation below takes the last's rows
    for phase, new, before in phases:
        shared = rng.permutation(context)  # one shifted body, shared c_KV, scattered slots
        ckv_idx = [np.concatenate([shared[:b], context + i * room + np.arange(n)])
                   for i, (n, b) in enumerate(zip(new, before))]
        base = [c.copy() for c in ckv_idx]  # the shared k_r rows a reuse rotates from
        own = [context + batch * room + i * (context + room) + np.arange(len(c))
               for i, c in enumerate(ckv_idx)]  # materialised: each request's rotated copy
        deltas = [rng.integers(-4000, 4000, len(c)) for c in ckv_idx]
        q = (torch.randn(sum(new), HEADS, RANK + ROPE, device=device, generator=gen) * 0.1)
        q = q.bfloat16()
        plain = PagedLayout.build(new, ckv_idx, own, HEADS, device)
        cidx = [torch.from_numpy(c).to(device) for c in ckv_idx]
        ridx = [torch.from_numpy(r).to(device) for r in own]
        run(f"{phase} torch", partial(torch_attention, q, ckv, kr[0], cidx, ridx, new, scale))
        run(f"{phase} kernel", partial(paged_mla_attention, q, ckv, kr[0], plain, scale))
        if phase == "prefill":  # the prefill tiles are the open question: try a few
            for block_m, tiles in PREFILL_TILES:
                layout = PagedLayout.build(new, ckv_idx, own, HEADS, device, block_m=block_m)
                run(f"prefill m{block_m} n{tiles.block_n} dv{tiles.dv} w{tiles.num_warps} "
                    f"s{tiles.num_stages}", partial(paged_mla_attention, q, ckv, kr[0], layout,
                                                    scale, tiles))
        launches = {"spans": GRAPH_LAUNCHES, "line": LINE_LAUNCHES}.get(phase, [])
        for block_m, splits in launches:
            layout = PagedLayout.build(new, ckv_idx, own, HEADS, device, block_m=block_m,
                                       splits=splits)
            run(f"{phase} m{block_m} s{splits}", partial(paged_mla_attention, q, ckv, kr[0],
                                                         layout, scale))
        if phase == "line":
            splits, rows = LINE_LAUNCHES[0][1], sum(new) * HEADS
            partial_out = torch.randn(splits, rows, RANK, device=device, generator=gen)
            lse = torch.randn(splits, rows, device=device, generator=gen)
            run(f"line merge of {splits} splits", partial(merge_splits, partial_out, lse,
                                                          torch.bfloat16))
    rot = torch.from_numpy(np.concatenate([base[0], own[0], deltas[0]])).to(device)
    layers = V2_LITE["num_hidden_layers"]
    pool = torch.randn(layers, slots, ROPE, device=device, generator=gen).bfloat16()
    nbytes = 2 * len(base[0]) * layers * ROPE * pool.element_size()
    for block, group, warps in ROTATE_SHAPES:
        label = f"materialise (27 layers) b{block} g{group} w{warps}"
        run(label, partial(rotate_kr, pool, rot, *rotary_args, block=block, group=group,
                           num_warps=warps))
        row[f"{label} GB/s"] = nbytes / (row[label]["p50_ms"] / 1e3) / 1e9
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 32768])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", help="write the results as JSON")
    args = parser.parse_args()
    rows = []
    for context in args.contexts:
        rows.append(measure(context, args.repeats))
        print("  ".join(f"{k} {v['p50_ms']:.3f} ms" if isinstance(v, dict) else
                        f"{k} {v:.0f}" if isinstance(v, float | int) else f"{k}: too big"
                        for k, v in rows[-1].items()), flush=True)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({**run_metadata("cuda"), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
