"""The fused norm / RoPE kernels (irminsul.kernels.fused_norm) against the torch path they replace
— ``residual + delta`` and RMSNorm; ``MLAttention.latent`` with ``PagedKV.store``; the query's
rotary — and against float64 hand computations.

bf16 results must lie within one bf16 ulp of the reference and nearly all be bit-equal (each
kernel rounds once, as torch does; float32 arithmetic in another order may flip a rare rounding).
Runs on CUDA, or on a CPU under Triton's interpreter (tests/conftest.py switches it on).
"""

from __future__ import annotations

import pytest
import torch

from irminsul.model import parse_config
from irminsul.model.mla import LATENT_NORM_EPS, MLAttention
from irminsul.model.norm import RMSNorm
from irminsul.model.paged import PagedKV
from irminsul.model.rope import Rotary

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EXACT_SHARE = 0.95  # bf16 values that must be bit-equal to the torch path's
HEADS = 20  # not a power of two, and more than one program's block of heads at rank 512

ROTARIES = {  # (rank, rope dim, overrides)
    # DeepSeek-V2-Lite's YaRN (interleaved pairs; its mscales cancel: magnitude 1)
    "v2_lite_yarn": (512, 64, dict(rope_scaling=dict(
        type="yarn", factor=40, original_max_position_embeddings=4096, beta_fast=32,
        beta_slow=1, mscale=0.707, mscale_all_dim=0.707))),
    "half_split": (128, 64, dict(model_type="deepseek_v3", rope_interleave=False)),
    "rope16": (128, 16, dict(rope_theta=50000.0)),
    # YaRN without mscale_all_dim: cos/sin carry a magnitude of 0.1·ln(40) + 1 ≈ 1.37
    "yarn_magnitude": (128, 64, dict(rope_scaling=dict(
        type="yarn", factor=40, original_max_position_embeddings=4096, beta_fast=32,
        beta_slow=1, mscale=1.0, mscale_all_dim=0))),
}


def attention_for(name: str, dtype: torch.dtype, seed: int) -> MLAttention:
    """One MLA layer of the named rotary's shape with random weights (the latent norm's too)."""
    rank, rope, overrides = ROTARIES[name]
    config = parse_config({**dict(
        model_type="deepseek_v2", vocab_size=64, hidden_size=64, num_hidden_layers=1,
        num_attention_heads=HEADS, kv_lora_rank=rank, qk_nope_head_dim=16, qk_rope_head_dim=rope,
        v_head_dim=16, intermediate_size=64, max_position_embeddings=163840,
        rope_theta=10000.0), **overrides})
    torch.manual_seed(seed)
    attn = MLAttention(config, Rotary(config))
    with torch.no_grad():
        attn.kv_a_layernorm.weight.uniform_(0.5, 1.5)
    return attn.to(device=DEVICE, dtype=dtype)


def positions_for(tokens: int, gen: torch.Generator) -> torch.Tensor:
    """Scattered positions up to the config's maximum, the second one 0 (an identity rotation
    beside real ones; a lone token gets a real one)."""
    positions = torch.randint(0, 163840, (tokens,), generator=gen)
    positions[1:2] = 0
    return positions.to(DEVICE)


def phasors(rotary: Rotary, positions: torch.Tensor) -> torch.Tensor:
    """The kernels' cis: the rotary's own complex phasors (magnitude included) as float32 pairs."""
    return torch.view_as_real(rotary._cis(positions, positions.device, rotary.magnitude))


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """One bf16 ulp at |x| (float64): 2^(e − 8) for |x| = m·2^e, m in [0.5, 1)."""
    _, exponent = torch.frexp(x.double().abs().clamp_min(2.0 ** -126))
    return torch.ldexp(torch.ones_like(x, dtype=torch.float64), exponent - 8)


def check(got: torch.Tensor, want: torch.Tensor, *, exact: bool = True) -> None:
    """got within one ulp (bf16) or 2e-6 of the largest magnitude (float32) of want; in bf16
    ``exact`` also asks that nearly every value be bit-equal (a reference rounded like the
    kernel: a one-sided error such as truncation would flip about half of them)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    got, want = got.cpu(), want.cpu()
    diff = (got.double() - want.double()).abs()
    if got.dtype == torch.float32:
        assert diff.max() <= 2e-6 * want.abs().max(), float(diff.max())
        return
    assert (diff <= bf16_ulp(want)).all(), float((diff / bf16_ulp(want)).max())
    if exact:
        share = (got == want).double().mean()
        assert share >= EXACT_SHARE, float(share)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, dim, weight_dtype", [
    (1, 96, None), (7, 448, torch.float32), (3, 7168, None)])
def test_add_rms_norm_matches_torch(tokens: int, dim: int, weight_dtype: torch.dtype | None,
                                    dtype: torch.dtype) -> None:
    from irminsul.kernels.fused_norm import add_rms_norm

    gen = torch.Generator().manual_seed(tokens * dim)
    # delta as a row-strided view (columns of a wider buffer): strides are followed, not copied
    delta = (torch.randn(tokens, dim + 32, generator=gen) * 0.5).to(dtype).to(DEVICE)[:, :dim]
    residual = (torch.randn(tokens, dim, generator=gen) * 4).to(dtype).to(DEVICE)
    norm = RMSNorm(dim, 1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5, generator=gen)
    norm = norm.to(device=DEVICE, dtype=weight_dtype or dtype)  # a float32 weight: rounded first
    widened = torch.full((tokens, dim), float("nan"), device=DEVICE)
    normed, summed = add_rms_norm(delta, residual, norm.weight, norm.eps, normed_float=widened)
    assert normed.is_contiguous() and summed.is_contiguous()
    assert torch.equal(widened, normed.float())  # the router's input, the same values widened
    # The torch path: the add, then the norm.
    want_summed = residual + delta
    assert torch.equal(summed, want_summed)
    with torch.no_grad():
        check(normed, norm(want_summed))
    # By hand in float64 from the rounded sum: the kernel rounds once, so within an ulp.
    s = want_summed.double().cpu()
    w = norm.weight.detach().to(dtype).double().cpu()
    check(normed, (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * w).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, terms, dim", [(1, 8, 96), (5, 3, 448), (2, 1, 2048)])
def test_add_rms_norm_sums_terms_as_torch(tokens: int, terms: int, dim: int,
                                          dtype: torch.dtype) -> None:
    """delta [T, J, D] (the routed experts' per-assignment outputs, a strided view) is summed
    over J as torch's ``delta.sum(1)`` sums it (float32, one rounding) before the add: the
    result equals the torch chain sum → add → norm, and within an ulp of float64 by hand."""
    from irminsul.kernels.fused_norm import add_rms_norm

    gen = torch.Generator().manual_seed(tokens * terms * dim)
    wide = (torch.randn(tokens, terms + 1, dim, generator=gen) * 0.5).to(dtype).to(DEVICE)
    delta = wide[:, 1:]  # not contiguous: strides are followed
    residual = (torch.randn(tokens, dim, generator=gen) * 4).to(dtype).to(DEVICE)
    norm = RMSNorm(dim, 1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5, generator=gen)
    norm = norm.to(device=DEVICE, dtype=dtype)
    normed, summed = add_rms_norm(delta, residual, norm.weight, norm.eps)
    want_summed = residual + delta.sum(1)
    if dtype == torch.bfloat16:  # both sum in float32 and round once: the same bf16 values
        assert torch.equal(summed, want_summed)
    else:  # float32 sums in another order (a CUDA reduction's tree) differ in the last bits
        torch.testing.assert_close(summed, want_summed, rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        check(normed, norm(want_summed))
    # The sum by hand: float64 over the terms, rounded to the dtype, then the add rounded
    # (float32 terms: the kernel's float32 adds round as they go, so within a few ulps).
    hand = (residual.double() + delta.double().sum(1).to(dtype).double()).to(dtype)
    if dtype == torch.bfloat16:
        assert torch.equal(summed, hand)
    else:
        torch.testing.assert_close(summed, hand, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 7])
@pytest.mark.parametrize("name", list(ROTARIES))
def test_store_latent_matches_torch_path(name: str, tokens: int, dtype: torch.dtype) -> None:
    """The pool after store_latent equals the pool after ``latent`` + ``PagedKV.store``: the
    tokens' scattered slots (c_KV slots ≠ k_r slots) written, every other slot and layer as it
    was."""
    from irminsul.kernels.fused_norm import store_latent

    attn = attention_for(name, dtype, seed=tokens)
    rank, rope = attn.rank, attn.rope_dim
    gen = torch.Generator().manual_seed(tokens + rope)
    x = torch.randn(tokens, 64, generator=gen).to(device=DEVICE, dtype=dtype)
    positions = positions_for(tokens, gen)
    ckv_slots = torch.randperm(40, generator=gen)[:tokens].to(DEVICE)
    kr_slots = (3 + torch.randperm(50, generator=gen)[:tokens]).to(DEVICE)
    layer = 1
    ckv = torch.randn(2, 40, rank, generator=gen).to(device=DEVICE, dtype=dtype)
    kr = torch.randn(2, 53, rope, generator=gen).to(device=DEVICE, dtype=dtype)
    want_ckv, want_kr = ckv.clone(), kr.clone()
    with torch.no_grad():
        kv_a = attn.kv_a_proj_with_mqa(x)
        if tokens > 1:  # a row-strided kv_a: the first columns of a wider projection
            kv_a = torch.cat([kv_a, torch.zeros_like(kv_a[:, :24])], dim=1)[:, :rank + rope]
        store_latent(kv_a, attn.kv_a_layernorm.weight, LATENT_NORM_EPS,
                     phasors(attn.rotary, positions), attn.rotary.interleaved, ckv[layer],
                     kr[layer], ckv_slots, kr_slots)
        # The torch path, on its own copy of the pool.
        kv = PagedKV(want_ckv, want_kr, ckv_slots, kr_slots, None, None, [])
        kv.store(layer, attn.latent(x, positions))
    check(ckv[layer, ckv_slots], want_ckv[layer, ckv_slots])
    check(kr[layer, kr_slots], want_kr[layer, kr_slots])
    for pool, want, slots in ((ckv, want_ckv, ckv_slots), (kr, want_kr, kr_slots)):
        untouched = torch.ones(pool.shape[1], dtype=torch.bool, device=DEVICE)
        untouched[slots] = False
        assert torch.equal(pool[:, untouched], want[:, untouched])
        assert torch.equal(pool[0], want[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("name", list(ROTARIES))
def test_store_latent_rotates_the_query_as_torch(name: str, tokens: int, dtype: torch.dtype
                                                 ) -> None:
    """store_latent's query rotation, from a split view of the q projection into the rope
    columns of a [T, H, rank + rope] buffer, equals ``Rotary.apply`` (``_query``); the buffer's
    other columns are left as they were, and the pool is written as without it."""
    from irminsul.kernels.fused_norm import store_latent

    attn = attention_for(name, dtype, seed=tokens + 10)
    rank, rope = attn.rank, attn.rope_dim
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 64, generator=gen).to(device=DEVICE, dtype=dtype)
    positions = positions_for(tokens, gen)
    slots = torch.randperm(16, generator=gen)[:tokens].to(DEVICE)
    ckv = torch.zeros(16, rank, device=DEVICE, dtype=dtype)
    kr = torch.zeros(16, rope, device=DEVICE, dtype=dtype)
    ckv_alone, kr_alone = ckv.clone(), kr.clone()
    query = torch.randn(tokens, HEADS, rank + rope, generator=gen).to(device=DEVICE, dtype=dtype)
    latent_before = query[..., :rank].clone()
    with torch.no_grad():
        q = attn.q_proj(x).view(tokens, HEADS, attn.nope + rope)
        kv_a = attn.kv_a_proj_with_mqa(x)
        cis = phasors(attn.rotary, positions)
        store_latent(kv_a, attn.kv_a_layernorm.weight, LATENT_NORM_EPS, cis,
                     attn.rotary.interleaved, ckv, kr, slots, slots, q_rope=q[..., attn.nope:],
                     q_out=query[..., rank:])
        store_latent(kv_a, attn.kv_a_layernorm.weight, LATENT_NORM_EPS, cis,
                     attn.rotary.interleaved, ckv_alone, kr_alone, slots, slots)
        _, want_rope = attn._query(x, positions)
    check(query[..., rank:], want_rope)
    assert torch.equal(query[..., :rank], latent_before)
    assert torch.equal(ckv, ckv_alone) and torch.equal(kr, kr_alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 17])
def test_store_latent_absorbs_the_query_as_torch(tokens: int, dtype: torch.dtype) -> None:
    """store_latent's absorb, from the nope columns of the q projection into the latent columns
    of the query buffer, equals ``MLAttention._absorb``'s product (in float64) over W_UK's rows of
    kv_b_proj (17 tokens: two token tiles); the rope columns get the rotation as without it."""
    from irminsul.kernels.fused_norm import store_latent

    attn = attention_for("v2_lite_yarn", dtype, seed=tokens + 20)
    rank, rope, nope = attn.rank, attn.rope_dim, attn.nope
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 64, generator=gen).to(device=DEVICE, dtype=dtype)
    positions = positions_for(tokens, gen)
    slots = torch.randperm(32, generator=gen)[:tokens].to(DEVICE)
    ckv = torch.zeros(32, rank, device=DEVICE, dtype=dtype)
    kr = torch.zeros(32, rope, device=DEVICE, dtype=dtype)
    query = torch.full((tokens, HEADS, rank + rope), float("nan"), device=DEVICE, dtype=dtype)
    with torch.no_grad():
        q = attn.q_proj(x).view(tokens, HEADS, nope + rope)
        w_uk, _ = attn._weights()
        store_latent(attn.kv_a_proj_with_mqa(x), attn.kv_a_layernorm.weight, LATENT_NORM_EPS,
                     phasors(attn.rotary, positions), attn.rotary.interleaved, ckv, kr, slots,
                     slots, q_rope=q[..., nope:], q_out=query[..., rank:], q_nope=q[..., :nope],
                     w_uk=w_uk, absorbed=query[..., :rank])
        want_nope, want_rope = attn._query(x, positions)
        # The product of the same bf16 / float32 values summed exactly (float64) and rounded
        # once: the kernel's float32 sums stay within an ulp of it. torch's CPU bmm is no
        # reference in bf16 (torch 2.13 lands up to 4 ulps from it).
        want = torch.bmm(want_nope.double().transpose(0, 1), w_uk.double()).transpose(0, 1)
    check(query[..., :rank], want.to(dtype), exact=False)
    check(query[..., rank:], want_rope)


def test_no_tokens_launch_nothing() -> None:
    from irminsul.kernels.fused_norm import add_rms_norm, store_latent

    normed, summed = add_rms_norm(torch.empty(0, 96, device=DEVICE),
                                  torch.empty(0, 96, device=DEVICE),
                                  torch.ones(96, device=DEVICE), 1e-6)
    assert normed.shape == summed.shape == (0, 96)
    ckv, kr = torch.randn(8, 32, device=DEVICE), torch.randn(8, 16, device=DEVICE)
    before = ckv.clone(), kr.clone()
    no_slots = torch.empty(0, dtype=torch.int64, device=DEVICE)
    store_latent(torch.empty(0, 48, device=DEVICE), torch.ones(32, device=DEVICE), 1e-6,
                 torch.empty(0, 8, 2, device=DEVICE), True, ckv, kr, no_slots, no_slots)
    assert torch.equal(ckv, before[0]) and torch.equal(kr, before[1])
    store_latent(torch.empty(0, 48, device=DEVICE), torch.ones(32, device=DEVICE), 1e-6,
                 torch.empty(0, 8, 2, device=DEVICE), True, ckv, kr, no_slots, no_slots,
                 q_rope=torch.empty(0, 4, 16, device=DEVICE),
                 q_out=torch.empty(0, 4, 16, device=DEVICE))
    assert torch.equal(ckv, before[0]) and torch.equal(kr, before[1])


def test_bad_arguments_raise() -> None:
    from irminsul.kernels.fused_norm import add_rms_norm, store_latent

    def t(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.zeros(*shape, dtype=dtype, device=DEVICE)

    with pytest.raises(ValueError, match="same T and D"):
        add_rms_norm(t(2, 96), t(2, 64), t(96), 1e-6)
    with pytest.raises(ValueError, match="same T and D"):
        add_rms_norm(t(2, 3, 96), t(3, 96), t(96), 1e-6)
    with pytest.raises(ValueError, match="share a floating dtype"):
        add_rms_norm(t(2, 96), t(2, 96, dtype=torch.bfloat16), t(96), 1e-6)
    with pytest.raises(ValueError, match="weight"):
        add_rms_norm(t(2, 96), t(2, 96), t(64), 1e-6)
    with pytest.raises(ValueError, match="hidden size"):
        add_rms_norm(t(1, 20000), t(1, 20000), t(20000), 1e-6)
    with pytest.raises(ValueError, match="normed_float"):
        add_rms_norm(t(2, 96), t(2, 96), t(96), 1e-6, normed_float=t(2, 96, dtype=torch.float16))
    with pytest.raises(ValueError, match="normed_float"):
        add_rms_norm(t(2, 96), t(2, 96), t(96), 1e-6, normed_float=t(96, 2).T)
    slots = torch.arange(3, device=DEVICE)
    good = dict(kv_a=t(3, 48), norm_weight=t(32), eps=1e-6, cis=t(3, 8, 2), interleaved=True,
                ckv=t(8, 32), kr=t(8, 16), ckv_slots=slots, kr_slots=slots)
    store_latent(**good)
    for change, message in ((dict(kv_a=t(3, 50)), "rank 32 \\+ rope 16"),
                            (dict(norm_weight=t(16)), "norm_weight"),
                            (dict(cis=t(3, 8, 2, dtype=torch.float64)), "cis"),
            (dict(q_nope=t(3, 2, 8)), "go together"),
            (dict(q_nope=t(3, 2, 8), w_uk=t(2, 8, 16), absorbed=t(3, 2, 32)), "do not fit"),
            (dict(q_nope=t(3, 2, 8), w_uk=t(2, 8, 32, dtype=torch.bfloat16),
                  absorbed=t(3, 2, 32)), "share a floating dtype"),
                            (dict(cis=t(3, 16)), "cis"),
                            (dict(kr_slots=slots.float()), "kr_slots"),
                            (dict(ckv_slots=slots[:2]), "ckv_slots"),
                            (dict(kv_a=t(3, 47), kr=t(8, 15), cis=t(3, 7, 2)), "odd"),
                            (dict(ckv=t(2, 8, 32)), "2-D")):
        with pytest.raises(ValueError, match=message):
            store_latent(**{**good, **change})
    with pytest.raises(ValueError, match="pass both or neither"):
        store_latent(**good, q_rope=t(3, 4, 16))
    with pytest.raises(ValueError, match="must both be"):
        store_latent(**good, q_rope=t(3, 4, 16), q_out=t(3, 5, 16))
    with pytest.raises(ValueError, match="must both be"):
        store_latent(**good, q_rope=t(3, 4, 12), q_out=t(3, 4, 12))
    with pytest.raises(ValueError, match="floating point"):
        store_latent(**good, q_rope=t(3, 4, 16), q_out=t(3, 4, 16, dtype=torch.int32))
