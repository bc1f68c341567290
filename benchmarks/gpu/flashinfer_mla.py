"""Anchor: FlashInfer's MLA paged decode kernel beside ours, on the same decode batches and data.

For each (batch, context): B requests × 1 new token over C keys of their own (``--ragged``: also
lengths drawn log-uniformly between 256 and C, as ``decode_attention.py`` draws them), 16 heads,
c_KV 512 + k_r 64, bf16. Our kernel (``paged_mla_attention``, the eager layout's default launch)
reads the per-token slot pool; FlashInfer's ``BatchMLAPagedAttentionWrapper`` (backends fa2 and
fa3, planned once, ``run`` timed) reads the same rows viewed as pages of 1 (our gather pattern) or
64 tokens. Both are timed as device time per call (``common.per_call``) and scored by the bytes
each must read (every key's 576-dim bf16 row, plus our two int32 slot ids per key or FlashInfer's
int32 page ids) over the measured copy bandwidth; their latent outputs [B, H, 512] are compared.
FlashInfer's import, JIT build (nvcc, timed apart) and each plan/run are guarded: a failure is
recorded as its error text and our kernel is still reported. FlashInfer comes from the pruned
bundle (benchmarks/gpu/flashinfer/README.md):

    . benchmarks/gpu/flashinfer/setup.sh && python benchmarks/gpu/flashinfer_mla.py --out F.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import roofline
import torch
from common import V2_LITE, decode_lengths, per_call, run_metadata

from irminsul.kernels import PagedLayout, paged_mla_attention
from irminsul.model import parse_config
from irminsul.model.rope import softmax_scale

HEADS, RANK, ROPE = 16, 512, 64
DTYPE = torch.bfloat16


def error(err: BaseException, tail: bool = False) -> dict[str, str]:
    """The error's first ~300 characters (and, for a build, its last 2000: the compiler's)."""
    text = f"{type(err).__name__}: {err}"
    return {"error": text[:300], **({"error_tail": text[-2000:]} if tail else {})}


def load_flashinfer(backends: list[str]) -> tuple[Any, dict[str, Any]]:
    """The flashinfer module (None if it fails to import) and the import and JIT build times."""
    info: dict[str, Any] = {}
    start = time.perf_counter()
    try:
        import flashinfer
        from flashinfer.jit import gen_batch_mla_module
    except Exception as err:  # any failure is the finding
        info["import"] = error(err)
        return None, info
    info["import"] = {"s": time.perf_counter() - start, "version": flashinfer.__version__}
    for backend in backends:
        start = time.perf_counter()
        try:
            gen_batch_mla_module(backend, DTYPE, DTYPE, DTYPE, torch.int32, RANK, ROPE,
                                 False).build_and_load()
            info[f"jit {backend}"] = {"s": time.perf_counter() - start}
        except Exception as err:
            info[f"jit {backend}"] = error(err, tail=True)
        print(f"FlashInfer {backend} JIT: {info[f'jit {backend}']}", flush=True)
    return flashinfer, info


def timed(fn: Callable[[], Any], repeats: int, floor_ms: float) -> dict[str, float]:
    ms = float(np.median([per_call("cuda", fn).device for _ in range(repeats)])) * 1e3
    return {"ms": ms, "floor_ms": floor_ms, "share_of_copy_bw": floor_ms / ms}


def flashinfer_cell(fi: Any, backend: str, page: int, q: torch.Tensor, ckv: torch.Tensor,
                    kr: torch.Tensor, starts: np.ndarray, lengths: np.ndarray, scale: float,
                    ours: torch.Tensor, workspace: torch.Tensor, copy_gbps: float,
                    repeats: int) -> dict[str, Any]:
    """Plan FlashInfer's wrapper for ``page``-token pages over the same rows (request i's keys
    are slots ``starts[i]`` on, every start a multiple of the largest page), then time ``run``."""
    batch, device = q.shape[0], q.device
    pages = -(-lengths // page)
    qo_indptr = torch.arange(batch + 1, dtype=torch.int32, device=device)
    kv_indptr = torch.tensor(np.concatenate([[0], np.cumsum(pages)]), dtype=torch.int32,
                             device=device)
    kv_indices = torch.tensor(np.concatenate([s // page + np.arange(n) for s, n in
                                              zip(starts, pages)]), dtype=torch.int32,
                              device=device)
    kv_len = torch.tensor(lengths, dtype=torch.int32, device=device)
    q_nope, q_pe = q[..., :RANK].contiguous(), q[..., RANK:].contiguous()
    ckv_pages, kr_pages = ckv.view(-1, page, RANK), kr.view(-1, page, ROPE)
    wrapper = fi.mla.BatchMLAPagedAttentionWrapper(workspace, backend=backend)
    common = dict(num_heads=HEADS, head_dim_ckv=RANK, head_dim_kpe=ROPE, page_size=page,
                  causal=False, sm_scale=scale, q_data_type=DTYPE, kv_data_type=DTYPE)
    if hasattr(fi.mla, "MLAPlanMetadata"):  # 0.7's preferred forms
        meta = fi.mla.MLAPlanMetadata.csr(qo_indptr, kv_indptr, kv_indices, kv_len)
        plan = dict(metadata=meta, query_layout="split", kv_cache_layout="split", **common)
        args = dict(query=(q_nope, q_pe), kv_cache=(ckv_pages, kr_pages))
    else:  # the flat CSR plan and split run arguments of earlier releases
        plan = dict(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices,
                    kv_len_arr=kv_len, **common)
        args = dict(q_nope=q_nope, q_pe=q_pe, ckv_cache=ckv_pages, kpe_cache=kr_pages)
    start = time.perf_counter()
    wrapper.plan(**plan)
    torch.cuda.synchronize()
    plan_s = time.perf_counter() - start
    out = wrapper.run(**args)
    diff = float((out.float() - ours.float()).abs().max() / ours.float().abs().max())
    nbytes = int(lengths.sum()) * (RANK + ROPE) * 2 + kv_indices.numel() * 4
    row = timed(lambda: wrapper.run(**args), repeats, nbytes / (copy_gbps * 1e9) * 1e3)
    return {**row, "rel_max_diff": diff, "plan_s": plan_s}


def cells(fi: Any, built: set[str], batch: int, context: int, ragged: bool, pages: list[int],
          backends: list[str], copy_gbps: float, repeats: int) -> dict[str, Any]:
    device = "cuda"
    scale = softmax_scale(parse_config(V2_LITE))
    lengths = decode_lengths(batch, context, ragged)
    # Each request's keys: its own contiguous run of slots, as a prefilled request holds them,
    # starting on a page boundary of every page size FlashInfer is given.
    align = max(pages, default=1)
    spans = -(-lengths // align) * align
    starts = np.concatenate([[0], np.cumsum(spans)[:-1]])
    gen = torch.Generator(device=device).manual_seed(0)
    ckv = torch.randn(int(spans.sum()), RANK, device=device, generator=gen).to(DTYPE)
    kr = torch.randn(int(spans.sum()), ROPE, device=device, generator=gen).to(DTYPE)
    q = (torch.randn(batch, HEADS, RANK + ROPE, device=device, generator=gen) * 0.1).to(DTYPE)
    keys = [s + np.arange(n) for s, n in zip(starts, lengths)]
    layout = PagedLayout.build([1] * batch, keys, keys, HEADS, device)
    ours = paged_mla_attention(q, ckv, kr, layout, scale)
    nbytes = int(lengths.sum()) * ((RANK + ROPE) * 2 + 8)
    row: dict[str, Any] = {"batch": batch, "context": context, "ragged": ragged,
                           "keys": int(lengths.sum()), "ours": timed(
        lambda: paged_mla_attention(q, ckv, kr, layout, scale), repeats,
        nbytes / (copy_gbps * 1e9) * 1e3)}
    workspace = torch.empty(128 * 2**20, dtype=torch.uint8, device=device)
    for page in pages:
        for backend in backends:
            key = f"flashinfer {backend} page {page}"
            if fi is None or backend not in built:
                row[key] = {"error": "flashinfer did not import or build (see 'flashinfer')"}
                continue
            try:
                row[key] = flashinfer_cell(fi, backend, page, q, ckv, kr, starts, lengths,
                                           scale, ours, workspace, copy_gbps, repeats)
            except Exception as err:  # recorded; ours is still reported
                row[key] = error(err)
    return row


def show(row: dict[str, Any], pages: list[int], backends: list[str]) -> None:
    def cell(v: dict[str, Any]) -> str:
        if "ms" not in v:
            return "failed: " + v["error"][:60].replace("|", "/").replace("\n", " ") + " | |"
        diff = f" | {v['rel_max_diff']:.1e}" if "rel_max_diff" in v else ""
        return f"{v['ms']:.3f} | {v['share_of_copy_bw']:.0%}{diff}"

    for page in pages:
        fis = " | ".join(cell(row[f"flashinfer {b} page {page}"]) for b in backends)
        lengths = "ragged" if row.get("ragged") else "uniform"
        print(f"| {row['batch']} | {row['context']} | {lengths} | {page} | {cell(row['ours'])} "
              f"| {fis} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--page-sizes", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--backends", nargs="+", default=["fa2", "fa3"])
    parser.add_argument("--ragged", action="store_true",
                        help="also ragged batches: lengths log-uniform between 256 and C")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    copy_gbps = roofline.copy_bandwidth("cuda")
    fi, info = load_flashinfer(args.backends)
    built = {b for b in args.backends if "s" in info.get(f"jit {b}", {})}
    out = {"meta": run_metadata("cuda"), "copy_gbps": copy_gbps, "flashinfer": info, "cells": []}
    heads = " | ".join(f"{b} ms | {b} bw | {b} diff" for b in args.backends)
    print(f"\n| B | C | lengths | page | ours ms | ours bw | {heads} |", flush=True)
    print("|" + " --- |" * (6 + 3 * len(args.backends)), flush=True)
    for context, ragged, batch in itertools.product(
            args.contexts, (False, True) if args.ragged else (False,), args.batches):
        if ragged and batch == 1:
            continue  # one request has nothing to be ragged against
        row = cells(fi, built, batch, context, ragged, args.page_sizes, args.backends,
                    copy_gbps, args.repeats)
        out["cells"].append(row)
        show(row, args.page_sizes, args.backends)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
