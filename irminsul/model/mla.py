"""Multi-head latent attention over the cache row ``[c_KV (kv_lora_rank) | k_r (qk_rope_head_dim)]``.

Two forms, equal in exact arithmetic (DeepSeek-V2 §2.1, the V3 reference's ``attn_impl="absorb"``):

* absorbed: W_UK is folded into the query (q̃ = W_UKᵀ q_nope, [kv_lora_rank] per head), every head
  attends to the *shared* latent rows as one MQA key/value head (keys 576 wide, values = c_KV, 512),
  and W_UV is applied after. This is how cached context is read by decode steps and short
  segments — a cached row needs no per-head expansion.
* naive: per-head K = [W_UK c | k_r] and V = W_UV c, ordinary attention (head dim 192 instead of
  576); cheaper for a fresh prefill and for any segment long enough to pay for expanding its
  context (:func:`naive_from`).

New tokens attend to every context row and causally to each other; a token's RoPE position is
whatever the caller says (context rows carry their own rotation inside k_r).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from .config import MLAConfig
from .fp8 import FP8Linear
from .norm import PendingNorm, RMSNorm
from .paged import PagedKV
from .rope import Rotary, softmax_scale

CUDNN_FROM = 4096  # CUDA: causal attention over this many keys or more may run in cuDNN...
SDPA_ALIGN = 64  # ...at lengths rounded up to a multiple of this (see MLAttention._attend)
SDPA_ANY = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
            SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
SDPA_NO_PLANS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
FLASH_DTYPES = (torch.bfloat16, torch.float16)  # the only dtypes flash attention takes
LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm eps in the reference code, not rms_norm_eps


def naive_from(config: MLAConfig) -> int:
    """New tokens from which a segment with context is cheaper in the naive form.

    Per head and (query, key) pair the absorbed form costs rank + rope + rank multiply-adds, the
    naive form nope + rope + v, plus rank · (nope + v) once per context row to expand it; so the
    naive form wins once a segment has more than rank·(nope + v) / (2·rank − nope − v) new tokens
    (171 for DeepSeek-V2/V3). Decode steps and short carve-outs stay absorbed.
    """
    rank, expand = config.kv_lora_rank, config.qk_nope_head_dim + config.v_head_dim
    return max(1, -(-rank * expand // max(1, 2 * rank - expand)))


class MLAttention(nn.Module):
    """One layer's attention; parameter names follow the Hugging Face checkpoints."""

    def __init__(self, config: MLAConfig, rotary: Rotary, layer: int = 0) -> None:
        super().__init__()
        self.layer = layer  # where this layer's rows live in a paged pool
        self.heads, self.nope, self.rope_dim = (config.num_attention_heads, config.qk_nope_head_dim,
                                                config.qk_rope_head_dim)
        self.v_dim, self.rank = config.v_head_dim, config.kv_lora_rank
        qk, bias, d = config.qk_head_dim, config.attention_bias, config.hidden_size
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(d, self.heads * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, config.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(config.q_lora_rank, self.heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, self.rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.rank, self.heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.heads * self.v_dim, d, bias=bias)
        self.rotary = rotary
        self.scale = softmax_scale(config)
        self.naive_from = naive_from(config)
        self.kernels = False  # fused Triton kernels for all-kernel batches (use_kernels)
        self._joint: dict[str, torch.Tensor] | None = None  # [first; kv_a] (join_projections)

    def _first(self) -> nn.Module:
        """The projection of x that makes the queries: q_proj, or q_a_proj with a q LoRA."""
        return self.q_proj if hasattr(self, "q_proj") else self.q_a_proj

    def join_projections(self) -> None:
        """Store the two projections of x (the queries' first, kv_a_proj_with_mqa) as one weight
        [N_q + rank + rope, D], each module's weight a view of its rows: a decode step then reads
        both in one GEMM (a launch fewer per layer, ~5.8 µs of an H200's batch-1 step). Plain
        linears, or FP8 linears whose first projection ends on a scale block (their scale grids
        joined the same way); bias-free only. A no-op otherwise."""
        first, kv = self._first(), self.kv_a_proj_with_mqa
        if first.bias is not None or kv.bias is not None or self._joined() is not None:
            return
        if type(first) is nn.Linear and type(kv) is nn.Linear:
            names: tuple[str, ...] = ("weight",)
        elif (isinstance(first, FP8Linear) and isinstance(kv, FP8Linear) and first.block == kv.block
              and first.out_features % first.block[0] == 0):
            names = ("weight", "weight_scale_inv")
        else:
            return
        if any(getattr(first, n).dtype != getattr(kv, n).dtype
               or getattr(first, n).device != getattr(kv, n).device for n in names):
            return
        joint = {}
        for name in names:
            a, b = getattr(first, name), getattr(kv, name)
            whole = torch.cat([a.detach(), b.detach()])
            setattr(first, name, nn.Parameter(whole[:a.shape[0]], requires_grad=a.requires_grad))
            setattr(kv, name, nn.Parameter(whole[a.shape[0]:], requires_grad=b.requires_grad))
            joint[name] = whole
        self._joint = joint

    def _joined(self) -> dict[str, torch.Tensor] | None:
        """The joint tensors while both modules still hold views of them (a weight replaced
        since, say by loading a new tensor object, ends the join: the two GEMMs run again)."""
        if self._joint is None:
            return None
        first, kv = self._first(), self.kv_a_proj_with_mqa
        for name, whole in self._joint.items():
            a, b = getattr(first, name, None), getattr(kv, name, None)
            # Addresses only (a decode step's hot path): kv's rows start where first's end.
            rows_bytes = whole.stride(0) * whole.element_size()
            if (a is None or b is None or a.data_ptr() != whole.data_ptr()
                    or a.shape[0] + b.shape[0] != whole.shape[0]
                    or b.data_ptr() != whole.data_ptr() + a.shape[0] * rows_bytes):
                return None
        return self._joint

    def _joint_projection(self, x: torch.Tensor, joint: dict[str, torch.Tensor]) -> torch.Tensor:
        """x through the joint weight: [T, N_q + rank + rope]."""
        if "weight_scale_inv" not in joint:
            return F.linear(x, joint["weight"])
        from ..kernels.fp8 import fp8_linear  # kernels on: the fused path runs only then

        return fp8_linear(x, joint["weight"], joint["weight_scale_inv"], self._first().block)

    def _projected(self, x: torch.Tensor, first: torch.Tensor | None = None) -> torch.Tensor:
        """The queries [T, H, nope + rope] of x, their RoPE part not yet rotated. ``first``:
        the first projection's output, already computed (the joint GEMM)."""
        if first is None:
            first = self._first()(x)
        q = first if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(first))
        return q.view(x.shape[0], self.heads, self.nope + self.rope_dim)

    def _query(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q_nope, q_rope = self._projected(x).split([self.nope, self.rope_dim], dim=-1)
        return q_nope, self.rotary.apply(q_rope, positions)

    def latent(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The cache rows of these tokens: [normed c_KV | k_r rotated to ``positions``], [T, L+R]."""
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope_dim], dim=-1)
        return torch.cat([self.kv_a_layernorm(c), self.rotary.apply(k_pe, positions)], dim=-1)

    @staticmethod
    def _absorb(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
        """q̃ = W_UKᵀ q_nope per head: [T, H, P] × [H, P, L] → [T, H, L] (one batched matmul;
        einsum would add a handful of reshapes per call, and launches are what decode pays)."""
        return torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)

    @staticmethod
    def _expand(latent: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
        """W_UV applied per head to latent outputs [H, T, L] × [H, V, L] → [T, H, V]."""
        return torch.bmm(latent, w_uv.transpose(1, 2)).transpose(0, 1)

    def _weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, P, L] and W_UV [H, V, L] from kv_b_proj."""
        w = self.kv_b_proj.weight.view(self.heads, self.nope + self.v_dim, self.rank)
        return w[:, :self.nope], w[:, self.nope:]

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                contexts: Sequence[torch.Tensor | None], lengths: Sequence[int], *,
                absorbed: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention output [T, D] and the new tokens' latent rows [T, L+R] for a ragged batch.

        ``x`` holds the new tokens of several sequences back to back (``lengths`` of them each);
        ``contexts[i]`` holds the latent rows of everything before sequence i's new tokens
        ([C_i, L+R], or None). Projections run over the whole batch; attention per sequence. By
        default the absorbed form runs when a sequence has context and the naive form when not.
        """
        q_nope, q_rope = self._query(x, positions)
        rows = self.latent(x, positions)
        outs, offset = [], 0
        for context, n in zip(contexts, lengths):
            span = slice(offset, offset + n)
            outs.append(self._attend(q_nope[span], q_rope[span], rows[span], context, absorbed))
            offset += n
        out = torch.cat(outs) if len(outs) > 1 else outs[0]
        return self.o_proj(out.reshape(x.shape[0], self.heads * self.v_dim)), rows

    def forward_paged(self, x: torch.Tensor, positions: torch.Tensor, kv: PagedKV,
                      pending: PendingNorm | None = None) -> torch.Tensor:
        """Attention output [T, D] of a batch of spans whose keys live in the pool ``kv``: the
        new rows are stored first; then the kernel's spans attend in one launch reading the pool
        in place, and each other span attends in torch to its context gathered from the pool.
        ``pending``: x is the residual stream, the add and norm before attention still to be
        applied (only where :meth:`folds_norm` says so; the joint projection's launch applies
        them)."""
        if self._fused(kv):
            return self._forward_fused(x, positions, kv, pending)
        if pending is not None:
            raise ValueError("a pending add + norm is applied only by the fused decode path "
                             "(see folds_norm)")
        q_nope, q_rope = self._query(x, positions)
        rows = self.latent(x, positions)
        kv.store(self.layer, rows)
        w_uk, w_uv = self._weights()
        out = x.new_empty(x.shape[0], self.heads, self.v_dim)
        if kv.layout is not None:
            from ..kernels import paged_mla_attention  # needs triton: only with a layout

            take = kv.kernel_tokens
            qn, qr = (q_nope, q_rope) if take is None else (q_nope[take], q_rope[take])
            q = torch.cat([self._absorb(qn, w_uk), qr], dim=-1)
            latent = paged_mla_attention(q, kv.ckv[self.layer], kv.kr[self.layer], kv.layout,
                                         self.scale)
            attended = self._expand(latent.transpose(0, 1), w_uv)
            if take is None:
                out = attended
            else:
                out[take] = attended
        for span, ckv_slots, kr_slots in kv.gathered:
            context = None if ckv_slots is None else torch.cat(
                [kv.ckv[self.layer, ckv_slots], kv.kr[self.layer, kr_slots]], dim=-1)
            out[span] = self._attend(q_nope[span], q_rope[span], rows[span], context, None)
        for spans in kv.masked:
            keys = torch.cat([kv.ckv[self.layer, spans.ckv], kv.kr[self.layer, spans.kr]], dim=-1)
            out[spans.rows] = self._attend_masked(q_nope[spans.rows], q_rope[spans.rows], keys,
                                                  spans.positions)
        return self.o_proj(out.reshape(x.shape[0], self.heads * self.v_dim))

    def _fused(self, kv: PagedKV) -> bool:
        """Whether :meth:`forward_paged` over ``kv`` runs :meth:`_forward_fused`: kernels on and
        every span in the attention kernel."""
        return self.kernels and kv.layout is not None and kv.kernel_tokens is None and not (
            kv.gathered or kv.masked)

    def folds_norm(self, x: torch.Tensor, kv: PagedKV) -> bool:
        """Whether :meth:`forward_paged` over ``x`` and ``kv`` takes the add + norm before it
        as ``pending``: the fused path, with the joint projection a GEMV whose launch can norm
        its row (:func:`~irminsul.kernels.gemv.normed_gemv`; ``gemv.FOLDS_NORM``)."""
        if not self._fused(kv):
            return False
        from ..kernels import gemv

        return gemv.FOLDS_NORM and self.reads_ahead(x)

    def _forward_fused(self, x: torch.Tensor, positions: torch.Tensor, kv: PagedKV,
                       pending: PendingNorm | None = None) -> torch.Tensor:
        """:meth:`forward_paged` of a batch whose every span attends in the kernel (decode steps,
        short spans), in few launches — a decode step is launch-bound: one kernel norms, rotates
        and stores the new latent rows and writes the attention query (its rope columns
        rotated, its latent part absorbed through W_UK); W_UV writes the o_proj's input layout
        directly; the same arithmetic as the torch ops they replace."""
        from ..kernels import gemv, paged_mla_attention, store_latent

        tokens = x.shape[0]
        joint = self._joined()
        if pending is not None:  # x is the residual: the GEMV's programs add and norm it
            if joint is None or not self._joint_gemv(x, joint):
                raise ValueError("a pending add + norm needs the joint projection as a GEMV")
            norm = pending.norm
            both, _ = gemv.normed_gemv(x, pending.delta, norm.weight, norm.eps, joint["weight"],
                                       pending.summed)
        elif joint is not None:
            both = (gemv.gemv(x, joint["weight"]) if self._joint_gemv(x, joint)
                    else self._joint_projection(x, joint))
        if joint is None:
            q, latent_in = self._projected(x), self.kv_a_proj_with_mqa(x)
        else:
            width = self._first().weight.shape[0]
            q, latent_in = self._projected(x, both[:, :width]), both[:, width:]
        cis = self.rotary.phasors(positions, x.device)
        norm = self.kv_a_layernorm
        query = x.new_empty(tokens, self.heads, self.rank + self.rope_dim)
        w_uk, w_uv = self._weights()
        # The same launch writes the query: its rope columns rotated, and its latent columns
        # q̃ = W_UKᵀ q_nope per head, as _absorb computes it (a bmm launch of its own before:
        # ~3.3 µs a layer of an H200's batch-1 step).
        store_latent(latent_in, norm.weight, norm.eps, cis,
                     self.rotary.interleaved, kv.ckv[self.layer], kv.kr[self.layer], kv.new_ckv,
                     kv.new_kr, q_rope=q[..., self.nope:], q_out=query[..., self.rank:],
                     q_nope=q[..., :self.nope], w_uk=w_uk, absorbed=query[..., :self.rank])
        uv_gemv = gemv.takes(tokens, x.dtype, w_uv)  # the merge lets it read W_UV meanwhile
        latent = paged_mla_attention(query, kv.ckv[self.layer], kv.kr[self.layer], kv.layout,
                                     self.scale, release=uv_gemv)
        # o_proj's input [T, H·V], written by W_UV head by head through a [H, T, V] view.
        out = x.new_empty(tokens, self.heads * self.v_dim)
        per_head = out.view(tokens, self.heads, self.v_dim).transpose(0, 1)
        o_proj = self.o_proj
        o_gemv = (type(o_proj) is nn.Linear and o_proj.bias is None
                  and gemv.fits(out, o_proj.weight))
        if uv_gemv:  # it lets o_proj's launch read its weight meanwhile
            gemv.gemv(latent.transpose(0, 1), w_uv, out=per_head, release=o_gemv)
        else:
            torch.bmm(latent.transpose(0, 1), w_uv.transpose(1, 2), out=per_head)
        return gemv.gemv(out, o_proj.weight) if o_gemv else o_proj(out)

    def _joint_gemv(self, x: torch.Tensor, joint: dict[str, torch.Tensor]) -> bool:
        """Whether the joint projection of ``x`` runs as :func:`~irminsul.kernels.gemv.gemv`
        (kernels on, a decode-sized batch, a plain weight of x's dtype)."""
        from ..kernels import gemv

        return "weight_scale_inv" not in joint and gemv.fits(x, joint["weight"])

    def reads_ahead(self, x: torch.Tensor) -> bool:
        """Whether :meth:`forward_paged`'s first launch over ``x`` reads its weight before
        waiting for the launch before it (the joint projection as a GEMV), so that launch may
        release it early. A guess at most costs time: a released launch that waits first only
        sits resident sooner."""
        joint = self._joined() if self.kernels else None
        return joint is not None and self._joint_gemv(x, joint)

    def _attend_masked(self, q_nope: torch.Tensor, q_rope: torch.Tensor, keys: torch.Tensor,
                       positions: torch.Tensor) -> torch.Tensor:
        """Tokens at ``positions`` (any order, any gaps) against a sequence's rows ``keys`` of
        positions 0..last, in the naive form, each seeing the rows at or before its position;
        [T, H, V]."""
        k, v = self._per_head(keys)
        q = torch.cat([q_nope, q_rope], dim=-1).transpose(0, 1)
        seen = torch.arange(keys.shape[0], device=keys.device)[None, :] <= positions[:, None]
        with sdpa_kernel(SDPA_NO_PLANS if keys.is_cuda else SDPA_ANY):
            out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=seen,
                                                 scale=self.scale)
        return out[0].transpose(0, 1)

    def _per_head(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The naive form's keys [H, L, nope + rope] and values [H, L, v] of latent rows
        ``keys`` [L, rank + rope]: c_KV expanded per head, k_r shared by every head."""
        w_uk, w_uv = self._weights()
        c, k_r = keys.split([self.rank, self.rope_dim], dim=-1)
        k = torch.cat([torch.matmul(c, w_uk.transpose(1, 2)),
                       k_r[None].expand(self.heads, -1, -1)], dim=-1)
        return k, torch.matmul(c, w_uv.transpose(1, 2))

    def _attend(self, q_nope: torch.Tensor, q_rope: torch.Tensor, rows: torch.Tensor,
                context: torch.Tensor | None, absorbed: bool | None) -> torch.Tensor:
        """One sequence: its new tokens' queries against its context and new rows; [T, H, V]."""
        keys = rows if context is None or context.shape[0] == 0 else torch.cat([context, rows])
        n_new, n_ctx = rows.shape[0], keys.shape[0] - rows.shape[0]
        # Token i sees every context row and new rows 0..i: plain causal attention without
        # context, causal aligned to the last key with it.
        if absorbed if absorbed is not None else 0 < n_ctx and n_new < self.naive_from:
            # One shared KV head: fold the query heads into the query length (rows h*T + t) and
            # run single-head attention, so the 576-wide keys are never expanded per head. Folded
            # rows need an explicit mask (token i sees the context and new rows 0..i); a single
            # new token sees everything and needs none.
            w_uk, w_uv = self._weights()
            c = keys[:, :self.rank]
            q = torch.cat([self._absorb(q_nope, w_uk), q_rope], dim=-1)
            folded = None if n_new == 1 else torch.ones(
                n_new, keys.shape[0], dtype=torch.bool, device=rows.device).tril(n_ctx).repeat(
                self.heads, 1)
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1).reshape(1, 1, self.heads * n_new, -1), keys[None, None],
                c[None, None], attn_mask=folded, scale=self.scale)  # [1, 1, H*T, L]
            return self._expand(out.view(self.heads, n_new, -1), w_uv)
        # SDPA's fastest kernels (cuDNN, flash) take only the top-left causal mask, but with
        # context the mask is aligned to the last key. While the context is no longer than the
        # segment, that many zero queries in front square the problem (where both alignments
        # agree) for less extra work than the slower kernel a lower-right mask selects; past
        # that, the mask as a bias object, never dense (a 16K segment's would be 256M cells).
        square = n_ctx <= n_new
        pad = n_ctx if square else 0
        # cuDNN's attention, SDPA's choice on Hopper for the square case, builds an execution
        # plan for every sequence length it has not seen: ~0.8 ms of host time per layer, ~20 ms
        # per prefill whose length is new, which in serving is nearly every one. Below
        # CUDNN_FROM keys the memory-efficient kernel runs instead (no plans; the attention of
        # a short span is a small part of its forward); from there rows appended to a multiple
        # of SDPA_ALIGN bound the plans, and they come last, so no real row sees them.
        cudnn = square and keys.is_cuda and keys.shape[0] >= CUDNN_FROM
        extra = -keys.shape[0] % SDPA_ALIGN if cudnn else 0
        k, v = self._per_head(F.pad(keys, (0, 0, 0, extra)) if extra else keys)
        q = torch.cat([q_nope, q_rope], dim=-1).transpose(0, 1)
        if pad or extra:
            q = torch.cat([q.new_zeros(self.heads, pad, q.shape[-1]), q,
                           q.new_zeros(self.heads, extra, q.shape[-1])], dim=1)
        bias = None if square or n_new == 1 else causal_lower_right(n_new, keys.shape[0])
        backends = SDPA_ANY if cudnn or not keys.is_cuda else SDPA_NO_PLANS
        if bias is not None and keys.is_cuda and q.dtype in FLASH_DTYPES:
            # A chunk after its context: the lower-right mask runs in flash attention, which
            # aligns causality to the last key, but only with values as wide as the keys; else
            # SDPA falls back to the memory-efficient kernel, ~4x slower here (H200, a 16K
            # prompt's 2K-token chunks: benchmarks/gpu/chunked_prefill.py). Zero value columns
            # cost 1.2x the multiply-adds and leave the others exact.
            v = F.pad(v, (0, q.shape[-1] - v.shape[-1]))
        with sdpa_kernel(backends):
            out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=bias,
                                                 is_causal=square, scale=self.scale)
        return out[0, :, pad:pad + n_new, :self.v_dim].transpose(0, 1)
