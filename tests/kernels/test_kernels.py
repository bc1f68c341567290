"""The Triton kernels against independent float64 references, and the engine's kernel path against
its plain-torch path.

Runs on CUDA, or on a CPU under Triton's interpreter (tests/conftest.py switches it on without CUDA).
"""

from __future__ import annotations

import builtins
import os

import numpy as np
import pytest
import torch
from fixtures.engine_scenario import assert_same, poison_graph_inputs, serve_shifted
from fixtures.tiny_models import build

from irminsul.config import EngineConfig
from irminsul.model import load_model, parse_config
from irminsul.model.rope import Rotary

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Seen with triton 3.6: the interpreter's tl.dot on bf16 operands returns garbage (a 16x16 product
# off by 2e10), so bf16 attention is checked on CUDA only; the rotation kernel computes in fp32.
INTERPRETER_BF16 = "Triton's CPU interpreter multiplies bf16 tiles wrongly; checked on CUDA"

ROTARIES = {  # (rank, rope dim, overrides): DeepSeek-V2-Lite's YaRN, a half-split, a 16-wide rope
    "v2_lite_yarn": (512, 64, dict(rope_scaling=dict(
        type="yarn", factor=40, original_max_position_embeddings=4096, beta_fast=32,
        beta_slow=1, mscale=0.707, mscale_all_dim=0.707))),
    "half_split": (128, 64, dict(model_type="deepseek_v3", rope_interleave=False)),
    "rope16": (128, 16, dict(rope_theta=50000.0)),
}


def rotary_for(name: str) -> Rotary:
    rank, rope, overrides = ROTARIES[name]
    config = dict(model_type="deepseek_v2", vocab_size=64, hidden_size=64, num_hidden_layers=1,
                  num_attention_heads=4, kv_lora_rank=rank, qk_nope_head_dim=16,
                  qk_rope_head_dim=rope, v_head_dim=16, intermediate_size=64,
                  max_position_embeddings=163840, rope_theta=10000.0)
    return Rotary(parse_config({**config, **overrides}))


@pytest.fixture(scope="module", autouse=True)
def interpreter_loops():
    """Triton's CPU interpreter hands loop bounds over as one-element arrays; Python's range
    wants integers. Only the interpreter needs this; compiled kernels never see it."""
    if DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    from irminsul.kernels import mla_attention, rotate

    def scalar(x: object) -> int:
        return int(np.asarray(getattr(getattr(x, "handle", None), "data", x)).reshape(-1)[0])

    namespaces = [mla_attention._mla_kernel.fn.__globals__, rotate._rotate_kernel.fn.__globals__]
    for namespace in namespaces:
        namespace["range"] = lambda *args: builtins.range(*map(scalar, args))
    yield
    for namespace in namespaces:
        del namespace["range"]


def exact_rotation(rotary: Rotary, rows: np.ndarray, delta: np.ndarray) -> np.ndarray:
    """rows [T, R] rotated by delta [T] in float64, pairs per the rotary's layout."""
    angles = delta[:, None].astype(np.float64) * rotary.inv_freq[None]
    cos, sin = np.cos(angles), np.sin(angles)
    x = rows.astype(np.float64).copy()
    half = rotary.dim // 2
    a_idx = np.arange(half) * 2 if rotary.interleaved else np.arange(half)
    b_idx = a_idx + 1 if rotary.interleaved else a_idx + half
    a, b = x[:, a_idx].copy(), x[:, b_idx].copy()
    x[:, a_idx], x[:, b_idx] = a * cos - b * sin, b * cos + a * sin
    return x


@pytest.mark.parametrize("name", list(ROTARIES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotate_kr_matches_exact_rotation(name: str, dtype: torch.dtype) -> None:
    from irminsul.kernels import rotate_kr

    rotary = rotary_for(name)
    gen = torch.Generator().manual_seed(1)
    layers = 9  # more than one group of layers per program
    kr = torch.randn(layers, 500, rotary.dim, generator=gen).to(dtype)
    before = kr.clone()
    src = torch.randperm(200, generator=gen)[:150]
    dst = 250 + torch.randperm(250, generator=gen)[:150]
    delta = torch.randint(-160000, 160000, (150,), generator=gen, dtype=torch.int32)
    delta[:4] = torch.tensor([0, 1, -1, 1023], dtype=torch.int32)
    kr = kr.to(DEVICE)
    rotate_kr(kr, torch.cat([src, dst, delta]).to(DEVICE), *rotary.kernel_args(DEVICE))
    kr = kr.cpu()
    for layer in range(layers):
        want = exact_rotation(rotary, before[layer, src].double().numpy(), delta.numpy())
        got = kr[layer, dst].double().numpy()
        tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: one rounding of the stored row
        assert np.abs(got - want).max() <= tol * np.abs(want).max()
    untouched = torch.ones(500, dtype=torch.bool)
    untouched[dst] = False
    assert torch.equal(kr[:, untouched], before[:, untouched])


def test_rotation_replays_any_count() -> None:
    """The engine's rotation (on CUDA a replayed graph, its row count read on the device):
    reuses of different sizes one after another, larger then smaller, each rotate exactly
    their own rows — a stale count or stale rows from the reuse before would write others."""
    from irminsul.engine.rotation import Rotation

    rotary = rotary_for("v2_lite_yarn")
    gen = torch.Generator().manual_seed(2)
    kr = torch.randn(3, 900, rotary.dim, generator=gen).to(DEVICE)
    rotation = Rotation(kr, rotary, max_rows=300)
    rng = np.random.default_rng(3)
    for n in (300, 7, 150, 1):
        before = kr.cpu()
        slots = rng.permutation(900)
        src, dst = slots[:n], slots[n:2 * n]
        delta = rng.integers(-100000, 100000, n)
        rotation(src, dst, delta)
        after = kr.cpu()
        for layer in range(3):
            want = exact_rotation(rotary, before[layer, src].double().numpy(), delta)
            got = after[layer, dst].double().numpy()
            assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
        untouched = np.ones(900, dtype=bool)
        untouched[dst] = False
        assert torch.equal(after[:, untouched], before[:, untouched])
    with pytest.raises(ValueError, match="a reuse of 301 rows exceeds the rotation's room of 300"):
        rotation(np.arange(301), np.arange(301) + 301, np.zeros(301, dtype=np.int64))


def attention_reference(q: torch.Tensor, ckv: torch.Tensor, kr: torch.Tensor, new: list[int],
                        ckv_idx: list[np.ndarray], kr_idx: list[np.ndarray], scale: float,
                        ) -> torch.Tensor:
    """Absorbed attention, float64, one request at a time, causal by list index."""
    outs, t0 = [], 0
    for n, c_i, r_i in zip(new, ckv_idx, kr_idx):
        keys = torch.cat([ckv[c_i], kr[r_i]], dim=-1).double()
        scores = torch.einsum("thd,kd->thk", q[t0:t0 + n].double(), keys) * scale
        visible = torch.arange(len(c_i))[None] <= (len(c_i) - n + torch.arange(n))[:, None]
        scores = scores.masked_fill(~visible[:, None], float("-inf"))
        outs.append(torch.einsum("thk,kd->thd", scores.softmax(-1), ckv[c_i].double()))
        t0 += n
    return torch.cat(outs)


CASES = {  # new tokens and keys per request: decode steps (split keys), prefill, mixed
    "decode": ([1, 1, 1], [900, 37, 300]),
    "prefill": ([5, 40, 3], [5, 300, 90]),
    "mixed": ([1, 64], [700, 64]),
}


@pytest.mark.parametrize("name", list(ROTARIES))
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_matches_reference(name: str, case: str, dtype: torch.dtype,
                                           monkeypatch) -> None:
    from irminsul.kernels import PagedLayout, TileConfig, mla_attention, paged_mla_attention

    if dtype == torch.bfloat16 and DEVICE == "cpu":
        pytest.skip(INTERPRETER_BF16)
    rotary = rotary_for(name)
    rank, heads, slots = ROTARIES[name][0], 4, 2000
    new, kv_len = CASES[case]
    rng = np.random.default_rng(2)
    ckv_idx = [rng.choice(slots, k, replace=False) for k in kv_len]
    kr_idx = [rng.choice(slots, k, replace=False) for k in kv_len]
    gen = torch.Generator().manual_seed(3)
    ckv = torch.randn(slots, rank, generator=gen).to(dtype)
    kr = torch.randn(slots, rotary.dim, generator=gen).to(dtype)
    q = (torch.randn(sum(new), heads, rank + rotary.dim, generator=gen) * 0.1).to(dtype)
    scale = 0.2
    want = attention_reference(q, ckv, kr, new, ckv_idx, kr_idx, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    # The default launch, and a fixed one as a CUDA graph captures (16-row blocks, 13 splits
    # per request whatever its length, so some get no keys).
    # And steps of 128 keys over splits aligned to 64, so a step runs into the next split (the
    # bfloat16 decode tiles; a float32 tile of 128 keys × 512 dims outgrows a GPU's shared memory).
    fixed = PagedLayout.build(new, ckv_idx, kr_idx, heads, DEVICE, block_m=16, splits=13)
    launches = [(PagedLayout.build(new, ckv_idx, kr_idx, heads, DEVICE), None), (fixed, None)]
    if dtype == torch.bfloat16 or DEVICE == "cpu":
        launches.append((fixed, TileConfig(128, rank, 4, 2)))
    launches.append((PagedLayout.build(new, ckv_idx, kr_idx, heads, DEVICE, block_m=16,
                                       splits=1), TileConfig(32, rank, 4, 2)))
    # 16-row launches in pieces, sized for one program (each block one piece), for five
    # (long blocks cut, partial outputs merged) and for eight.
    for programs in (1, 5, 8):
        launches.append((PagedLayout.build(new, ckv_idx, kr_idx, heads, DEVICE, block_m=16,
                                           programs=programs), None))
    for layout, tiles in launches:
        got = paged_mla_attention(q.to(DEVICE), ckv.to(DEVICE), kr.to(DEVICE), layout, scale,
                                  tiles)
        assert got.dtype == dtype
        assert (got.cpu().double() - want).abs().max() <= tol * want.abs().max()
    # The pieces' merge a row (and 4 rows) per program, pieces of whole 64-key steps.
    for rows in (1, 4):
        monkeypatch.setattr(mla_attention, "MERGE_ROWS", rows)
        monkeypatch.setattr(mla_attention, "MERGE_BY_ROW_UP_TO", 1 << 20)
        layout = PagedLayout.build(new, ckv_idx, kr_idx, heads, DEVICE, block_m=16, programs=5,
                                   align=64)
        got = paged_mla_attention(q.to(DEVICE), ckv.to(DEVICE), kr.to(DEVICE), layout, scale)
        assert (got.cpu().double() - want).abs().max() <= tol * want.abs().max()


def test_pieces_cut_each_block_by_its_length() -> None:
    """The schedule of 16-row launches, by hand: 400 keys within 3 programs take chunks of
    150 (the shortest that fit); a block of 100 keys is one piece, an empty block none, a block
    of 300 two of 150."""
    from irminsul.kernels import PagedLayout

    table = PagedLayout.plan(np.array([100, 0, 300]), programs=3, room=4)
    pieces, room = table[0], 4
    block, start, end = table[1:1 + room], table[1 + room:1 + 2 * room], table[1 + 2 * room:13]
    assert pieces == 3
    assert block[:3].tolist() == [0, 2, 2]
    assert start[:3].tolist() == [0, 0, 150] and end[:3].tolist() == [100, 150, 300]
    assert table[13:16].tolist() == [0, 1, 1] and table[16:].tolist() == [1, 0, 2]
    # Uniform blocks fill the programs evenly: 64 blocks of 4096 keys over 132 programs are
    # 2 pieces of 2048 each (one wave), not 3 of 1366 (a second, partial wave).
    table = PagedLayout.plan(np.full(64, 4096), programs=132)
    assert table[0] == 128 and set(np.diff(table[1 + 128:1 + 256])[::2].tolist()) == {2048}
    # At least 64 keys a piece; more blocks than programs: one piece each.
    assert PagedLayout.plan(np.array([10, 10, 10]), programs=132)[0] == 3
    assert PagedLayout.plan(np.full(200, 4096), programs=132)[0] == 200
    with pytest.raises(ValueError, match="4 pieces exceed the launch's room of 3"):
        PagedLayout.plan(np.array([64, 64, 64, 64]), programs=4, least=16, room=3)
    # A short PIC forward: a 31-token line at position 50 (blocks seeing 51 .. 81 keys), then
    # the last token over 16K. Within 264 programs the shortest chunk is 73 keys: the 8 blocks
    # over 73 keys in two pieces, 23 in one, 16384 keys in 225 (72 keys: 40 + 228 > 264); each
    # of those two 64-key steps. Rounded up to whole steps, 128 keys: 31 + 128 pieces, still
    # two steps each.
    work = np.array([*range(51, 82), 16384])
    for align, chunk, pieces, last in ((1, 73, 264, 225), (64, 128, 159, 128)):
        table = PagedLayout.plan(work, programs=264, align=align)
        n = int(table[0])
        block = table[1:1 + n]
        sizes = table[1 + 2 * n:1 + 3 * n] - table[1 + n:1 + 2 * n]
        assert n == pieces and (block == 31).sum() == last
        assert sizes.max() == chunk and sizes[block == 31].sum() == 16384


def test_engine_kernel_path_equals_torch_path(tmp_path) -> None:
    """Live PIC prefill, decode and a mixed scheduler batch: the kernel path (attention in place,
    rotation kernel) gives the plain-torch path's logits and tokens; accounting stays exact."""
    from irminsul.engine import Engine

    build("v2_lite_like", tmp_path, layers=2)
    model = load_model(tmp_path, device=DEVICE)
    served = {kernels: serve_shifted(
        Engine(model, EngineConfig(slots=3000, mode="live", kernels=kernels)), seed=6, headers=(40, 45),
        docs=(150, 120), question=9, requests=lambda source, target, _: [source, target[:90]],
        batch_tokens=200, chunk_tokens=64, max_tokens=5) for kernels in (False, True)}
    assert served[False].pic_tokens >= 200
    assert_same(served[True], served[False], 1e-3)


def test_masked_multi_span_prefill_equals_span_by_span(tmp_path, monkeypatch) -> None:
    """A target whose reused documents split its computed tokens into a long header (past the
    kernel's span limit) and a short question attends in one masked call per layer on the kernel
    path; it serves what attending span by span (header in torch, question in the kernel)
    serves. So does a prompt whose spans before its question merge while the question, past
    MERGED_MAX_KEYS, attends in the kernel beside them."""
    import irminsul.engine.model_runner as runner_module
    from irminsul.engine import Engine
    from irminsul.model.mla import naive_from

    build("v2_lite_like", tmp_path, layers=2)
    model = load_model(tmp_path, device=DEVICE)
    from irminsul.model.mla import MLAttention

    header = naive_from(model.config) + 29
    served, calls, mixed = {}, [], []
    masked = MLAttention._attend_masked
    monkeypatch.setattr(MLAttention, "_attend_masked",
                        lambda self, *a: calls.append(1) or masked(self, *a))
    route = runner_module.ModelRunner._route

    def routed(self, batch):  # a forward with a masked call and kernel spans side by side
        kernel, gathered, merged = route(self, batch)
        mixed.append(bool(kernel and merged))
        return kernel, gathered, merged

    monkeypatch.setattr(runner_module.ModelRunner, "_route", routed)
    fresh = np.random.default_rng(3).integers(0, 97, header + 20)

    def three_spans(source, target, doc_a):  # a new header, B, 20 new tokens, A, the question
        return [np.concatenate([fresh[:header], target[header:header + 120], fresh[header:],
                                doc_a, target[-9:]])]

    cases = {"merged": (runner_module.MERGED_MAX_KEYS, lambda s, t, _: [t[:header + 100]]),
             "split": (0, lambda s, t, _: [t[:header + 100]]),
             "early": (header + 120 + 20 + 150, three_spans),
             "early split": (0, three_spans)}
    for how, (limit, requests) in cases.items():
        monkeypatch.setattr(runner_module, "MERGED_MAX_KEYS", limit)
        calls.clear()
        mixed.clear()
        served[how] = serve_shifted(
            Engine(model, EngineConfig(slots=3000, mode="live", kernels=True)), seed=9,
            headers=(40, header), docs=(150, 120), question=9, requests=requests,
            batch_tokens=600, chunk_tokens=600, max_tokens=3)
        assert bool(calls) == (limit > 0), how  # the masked call ran, or did not
        assert any(mixed) == (how == "early"), how
    assert served["merged"].pic_tokens >= 200
    assert_same(served["merged"], served["split"], 1e-3)
    assert_same(served["early"], served["early split"], 1e-3)


@pytest.mark.skipif(DEVICE == "cuda", reason="on a GPU graphs need bfloat16: "
                    "test_model_gpu.py::test_cuda_graphs_equal_eager_forwards replays them")
def test_graph_path_equals_eager_path(tmp_path, monkeypatch) -> None:
    """The forwards a CUDA graph replays — batches padded to their bucket, inputs in static
    buffers, the kernel at the graphs' fixed launch shape, padding rows in the scratch slot — give
    the eager kernel path's logits and tokens (off a GPU, run as they are, in float32);
    accounting stays exact, the scratch slot included. Short forwards count up to 64 tokens
    here, so that the source's prefill replays a bucket of 64-row blocks."""
    from irminsul.engine import Engine
    from irminsul.kernels import mla_attention

    monkeypatch.setattr(mla_attention, "SHORT_FORWARD", 64)

    build("v2_lite_like", tmp_path, layers=2, heads=16)
    model = load_model(tmp_path, device=DEVICE)
    served, engines = {}, {}
    for graphs in (False, True):
        engines[graphs] = Engine(model, EngineConfig(slots=3000, mode="live", kernels=True,
                                                     graphs=graphs))
        if graphs:
            poison_graph_inputs(engines[graphs])
        served[graphs] = serve_shifted(
            engines[graphs], seed=8, headers=(40, 29), docs=(120, 90), question=9,
            requests=lambda _, target, doc_a: [target[:60], doc_a[:30]], batch_tokens=64,
            chunk_tokens=24, max_tokens=4)
    replays = engines[True].runner.graphs.replays  # extend, the scheduler's short spans and steps
    assert replays.total() >= 5
    assert {rows for _, rows in replays} == {16, 64}  # short forwards, and 64-row blocks too
    assert replays[256, 64] >= 1  # the source's 250-token prefill, long spans in the kernel
    assert served[False].pic_tokens >= 100  # doc A; doc B starts inside the first 32 positions
    assert_same(served[True], served[False], 1e-4)


@pytest.mark.skipif(DEVICE == "cuda", reason="on a GPU graphs need bfloat16: "
                    "test_model_gpu.py::test_cuda_graphs_equal_eager_forwards replays them")
def test_decode_graphs_of_many_requests_equal_eager_decode(tmp_path) -> None:
    """Twelve requests decoding together replay the 16-token bucket's graph of 16-row blocks
    (one token's heads each, not 64-row blocks a quarter full): their greedy tokens equal the
    eager kernel path's."""
    from irminsul.engine import Engine, SamplingParams, Scheduler

    build("v2_lite_like", tmp_path, layers=2, heads=16)
    model = load_model(tmp_path, device=DEVICE)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 97, int(rng.integers(20, 120))) for _ in range(12)]
    tokens, replays = {}, None
    for graphs in (False, True):
        engine = Engine(model, EngineConfig(slots=3000, mode="off", kernels=True, graphs=graphs))
        scheduler = Scheduler(engine, batch_tokens=2000, chunk_tokens=200)
        ids = [scheduler.add(p, SamplingParams(max_tokens=5)) for p in prompts]
        out: dict[str, list[int]] = {i: [] for i in ids}
        while scheduler.has_work():
            for step in scheduler.step():
                out[step.request_id] += step.new_tokens
        engine.check()
        tokens[graphs] = list(out.values())
        if graphs:
            replays = engine.runner.graphs.replays
    assert replays[16, 16] >= 4 and not replays[16, 64]  # every decode step: 16-row blocks
    assert tokens[True] == tokens[False]


def test_graphs_leave_the_whole_capacity_to_requests(tmp_path) -> None:
    """The slot the graphs' padding rows are written to lies outside the pool's capacity: a
    request needing exactly the capacity is admitted and served with graphs as without."""
    from irminsul.engine import Engine, SamplingParams, Scheduler

    build("v2_lite_like", tmp_path, layers=1, heads=16)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32  # CUDA graphs need bf16
    model = load_model(tmp_path, device=DEVICE, dtype=dtype)
    for graphs in (False, True):
        engine = Engine(model, EngineConfig(slots=64, mode="live", kernels=True, graphs=graphs))
        assert engine.pool.capacity == 64
        scheduler = Scheduler(engine, batch_tokens=64, chunk_tokens=64)
        scheduler.add(np.arange(60) % 97, SamplingParams(max_tokens=4))
        tokens = []
        for _ in range(20):  # bounded: a request that is never admitted would spin here
            tokens += [t for out in scheduler.step() for t in out.new_tokens]
            if not scheduler.has_work():
                break
        assert len(tokens) == 4 and not scheduler.has_work()
        engine.check()


@pytest.mark.parametrize("heads", [16, 128])
def test_graph_block_room_holds_every_batch_of_its_bucket(heads: int) -> None:
    """For random batches of every bucket (spans of any sizes, the padding request last), the
    blocks the kernel layout makes never exceed the room the bucket's graph keeps for them; a
    batch of one-token spans fills the room exactly where blocks hold one token's heads."""
    from irminsul.engine.graphs import BUCKETS, block_room, launches
    from irminsul.kernels import PagedLayout

    rng = np.random.default_rng(0)
    variants = launches(BUCKETS, heads)
    assert [bucket for bucket, _ in variants] == list(BUCKETS)
    # 16 heads: 16-row blocks up to the kernel's short forwards (512 tokens), then 64; 128
    # heads: 16-row blocks up to 8 tokens (decode steps), then 64.
    assert [rows for _, rows in variants] == [16 if b <= (512 if heads == 16 else 8) else 64
                                              for b in BUCKETS]
    for bucket, rows in variants:
        room = block_room(bucket, heads, rows)
        for _ in range(50):
            n = int(rng.integers(1, bucket + 1))
            cuts = np.sort(rng.choice(np.arange(1, n), size=int(rng.integers(0, n)),
                                      replace=False)) if n > 1 else np.array([], dtype=int)
            spans = np.diff(np.concatenate([[0], cuts, [n]])).tolist()
            new = spans + ([bucket - n] if bucket > n else [])
            assert sum(new) == bucket and min(new) >= 1
            assert len(PagedLayout.blocks(new, heads, rows)[0]) <= room
        worst = len(PagedLayout.blocks([1] * bucket, heads, rows)[0])
        assert worst <= room
        if heads % rows == 0:
            assert worst == room


@pytest.mark.skipif(DEVICE == "cuda", reason="on a GPU graphs need bfloat16: "
                    "test_model_gpu.py::test_cuda_graphs_equal_eager_forwards replays them")
def test_steps_prepared_ahead_decode_as_the_eager_path(tmp_path) -> None:
    """Decode steps whose batch was prepared during the step before (slots and graph inputs
    ahead of the token ids) give the eager path's greedy tokens; a request stopped by a stop
    token, one aborted between steps and one arriving late each make the prepared batch be given
    back, and the slot accounting stays exact throughout. Greedy steps are launched before the
    host reads the tokens they take (overlapped); a sampled request keeps its batch on the host
    path."""
    from irminsul.engine import Engine, SamplingParams, Scheduler

    build("v2_lite_like", tmp_path, layers=1, heads=16)
    model = load_model(tmp_path, device=DEVICE)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 97, int(rng.integers(10, 40))) for _ in range(5)]
    late = rng.integers(0, 97, 25)
    runs = {}
    for graphs in (False, True):
        engine = Engine(model, EngineConfig(slots=2000, mode="off", kernels=True, graphs=graphs))
        scheduler = Scheduler(engine, batch_tokens=512, chunk_tokens=64)
        ids = [scheduler.add(p, SamplingParams(max_tokens=8)) for p in prompts]
        out: dict[str, list[int]] = {i: [] for i in ids}
        steps = 0
        while scheduler.has_work():
            for o in scheduler.step():
                out.setdefault(o.request_id, []).extend(o.new_tokens)
            steps += 1
            if steps == 3:
                scheduler.abort(ids[1])
                engine.check()  # nothing held for the aborted request's prepared step
            if steps == 5:
                out[scheduler.add(late, SamplingParams(max_tokens=3))] = []
        engine.check()
        runs[graphs] = (out, scheduler.prepared_steps, scheduler.overlapped_steps)
    assert runs[False][1] == runs[False][2] == 0
    assert runs[True][1] >= 4  # steady decode between the interruptions ran prepared
    assert runs[True][2] == runs[True][1]  # every greedy prepared step launched ahead
    assert runs[True][0] == runs[False][0]
    # One sampled request among greedy ones: prepared steps, none launched ahead (its token is
    # drawn on the host), the greedy requests' tokens unchanged.
    engine = Engine(model, EngineConfig(slots=2000, mode="off", kernels=True, graphs=True))
    scheduler = Scheduler(engine, batch_tokens=512, chunk_tokens=64)
    greedy = scheduler.add(prompts[3], SamplingParams(max_tokens=8))
    scheduler.add(prompts[4], SamplingParams(max_tokens=8, temperature=0.8, seed=1))
    mixed: dict[str, list[int]] = {}
    while scheduler.has_work():
        for o in scheduler.step():
            mixed.setdefault(o.request_id, []).extend(o.new_tokens)
    engine.check()
    assert scheduler.prepared_steps >= 4 and scheduler.overlapped_steps == 0
    assert mixed[greedy] == runs[False][0][ids[3]]
    # A stop token: the first request's third token stops it (taken from the run above).
    stop = runs[False][0][ids[0]][2]
    engine = Engine(model, EngineConfig(slots=2000, mode="off", kernels=True, graphs=True))
    scheduler = Scheduler(engine, batch_tokens=512, chunk_tokens=64)
    first = scheduler.add(prompts[0], SamplingParams(max_tokens=8, stop_token_ids=(stop,)))
    other = scheduler.add(prompts[2], SamplingParams(max_tokens=8))
    got: dict[str, list[int]] = {first: [], other: []}
    while scheduler.has_work():
        for o in scheduler.step():
            got[o.request_id] += o.new_tokens
    engine.check()
    want = runs[False][0][ids[0]]
    assert got[first] == want[:want.index(stop) + 1]
    assert got[other] == runs[False][0][ids[2]]
    # A request dropped (the server's last resort when its abort raised) while a step was
    # launched ahead for it: that step emits nothing for it, the other request goes on as if
    # alone. Its third token would have finished it inside that step.
    engine = Engine(model, EngineConfig(slots=2000, mode="off", kernels=True, graphs=True))
    scheduler = Scheduler(engine, batch_tokens=512, chunk_tokens=64)
    dropped = scheduler.add(prompts[0], SamplingParams(max_tokens=3))
    other = scheduler.add(prompts[2], SamplingParams(max_tokens=8))
    got = {dropped: [], other: []}
    for _ in range(2):
        for o in scheduler.step():
            got[o.request_id] += o.new_tokens
    assert scheduler.overlapped_steps >= 1  # the next step is on the device already
    scheduler.drop(dropped)
    while scheduler.has_work():
        for o in scheduler.step():
            got[o.request_id] += o.new_tokens
    assert got[dropped] == runs[False][0][ids[0]][:2]
    assert got[other] == runs[False][0][ids[2]]


@pytest.mark.skipif(DEVICE == "cuda", reason="on a GPU graphs need bfloat16: "
                    "test_model_gpu.py::test_cuda_graphs_equal_eager_forwards replays them")
def test_non_finite_logits_of_a_step_launched_ahead_fail_their_request_alone(
        tmp_path, monkeypatch) -> None:
    """Greedy steps launched before the host reads their tokens: a request whose logits turn
    NaN in such a step fails alone (its argmax, the NaN's index, fed a row the next step
    skips), read back with the ids; the other requests' tokens are those of a run without it
    and the slot accounting stays exact."""
    from irminsul.engine import Engine, SamplingParams, Scheduler

    build("v2_lite_like", tmp_path, layers=1, heads=16)
    model = load_model(tmp_path, device=DEVICE)
    rng = np.random.default_rng(6)
    prompts = [rng.integers(0, 97, int(rng.integers(10, 40))) for _ in range(3)]
    poison_at = len(prompts[2]) + 2  # the forward that gives its fourth token's logits
    hit: list[str] = []

    def poisoning(real, name):
        def forward(self, prepared_or_work, *args, **kw):
            logits = real(self, prepared_or_work, *args, **kw)
            work = getattr(prepared_or_work, "work", prepared_or_work)
            for i, (seq, _, _) in enumerate(work):
                if seq.namespace == 666 and len(seq.tokens) == poison_at:
                    logits[i] = logits[i].clone()  # an inference tensor: not written in place
                    logits[i][-1, 7] = float("nan")
                    hit.append(name)
            return logits
        return forward

    monkeypatch.setattr(Engine, "run_batch", poisoning(Engine.run_batch, "eager"))
    monkeypatch.setattr(Engine, "run_prepared", poisoning(Engine.run_prepared, "ahead"))
    runs = {}
    for poison in (False, True):
        engine = Engine(model, EngineConfig(slots=2000, mode="off", kernels=True, graphs=True))
        scheduler = Scheduler(engine, batch_tokens=512, chunk_tokens=64)
        for i, prompt in enumerate(prompts[:2 + poison]):
            scheduler.add(prompt, SamplingParams(max_tokens=6), request_id=f"r{i}",
                          namespace=666 if i == 2 else 0)
        got: dict[str, list[int]] = {}
        errors: dict[str, str] = {}
        while scheduler.has_work():
            for o in scheduler.step():
                got.setdefault(o.request_id, []).extend(o.new_tokens)
                if o.error is not None:
                    errors[o.request_id] = o.error
        engine.check()
        assert not engine.sequences
        runs[poison] = got, errors, scheduler.overlapped_steps
    assert hit == ["ahead"]  # the fault came in a step launched ahead
    got, errors, overlapped = runs[True]
    assert overlapped >= 3 and not runs[False][1]
    assert set(errors) == {"r2"} and "not finite (NaN or infinite) after 3 generated" in \
        errors["r2"]
    assert len(got["r2"]) == 3
    assert {k: v for k, v in got.items() if k != "r2"} == runs[False][0]


@pytest.mark.parametrize("splits,rows,rank", [(2, 17, 512), (5, 3, 64), (64, 16, 128),
                                             (128, 16, 512)])
def test_merge_splits_matches_float64(splits: int, rows: int, rank: int) -> None:
    """The split merge against the log-sum-exp weighting in float64: out = Σ_s 2^lse_s · out_s /
    Σ_s 2^lse_s, a split that saw no key (lse −inf) weighing nothing and not read: the
    attention kernel writes no partial output there, so it holds NaN here."""
    from irminsul.kernels.mla_attention import merge_splits

    gen = torch.Generator().manual_seed(splits * 1000 + rows)
    out = torch.randn(splits, rows, rank, generator=gen)
    lse = torch.randn(splits, rows, generator=gen) * 4
    lse[0, 1] = float("-inf")  # one split of one row saw nothing
    if splits > 2:
        lse[splits // 2:] = float("-inf")  # whole splits past a short request's keys
    weights = torch.exp2(lse.double())
    want = (out.double() * (weights / weights.sum(0))[..., None]).sum(0)
    out[lse == float("-inf")] = float("nan")  # never written: must not be read
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        got = merge_splits(out.to(DEVICE), lse.to(DEVICE), dtype)
        assert got.dtype == dtype and got.shape == (rows, rank)
        err = (got.double().cpu() - want).abs().max()
        assert err <= tol * want.abs().max(), float(err)


def test_fp8_kernel_path_equals_torch_path(tmp_path) -> None:
    """A model kept in FP8 (16 × 16 blocks, random float8 weights): live PIC prefill, decode and
    a scheduler batch through the kernels — the float8 linears, its joined q_proj / kv_a GEMM,
    the FP8 experts — give the torch path's logits and tokens."""
    from fixtures.fp8_config import small_fp8_config

    from irminsul.engine import Engine
    from irminsul.model import load_config
    from irminsul.model.random_weights import random_model

    config = load_config(small_fp8_config(tmp_path).parent)
    model = random_model(config, DEVICE, torch.float32, keep_fp8=True)
    served = {kernels: serve_shifted(
        Engine(model, EngineConfig(slots=3000, mode="live", kernels=kernels)), seed=3,
        headers=(40, 45), docs=(150, 120), question=9,
        requests=lambda source, target, _: [source, target[:90]], batch_tokens=200,
        chunk_tokens=64, max_tokens=4) for kernels in (False, True)}
    attention = model.model.layers[0].self_attn
    assert attention._joined() is not None and "weight_scale_inv" in attention._joined()
    assert served[False].pic_tokens >= 200
    assert_same(served[True], served[False], 1e-3)


def test_key_splits_follow_the_sms_and_the_keys() -> None:
    """Hand-computed from the rule on 132 SMs (:data:`irminsul.device.SMS`, a CPU's stand-in):
    16-row blocks get the power of two at or below 132 / blocks, at most 128, at least 64 keys
    each; 64-row blocks ceil(264 / blocks), at most 64, at least 256 keys each."""
    from irminsul.kernels.mla_attention import key_splits

    assert key_splits(1, 16, "cpu") == 128
    assert key_splits(1, 16, "cpu", max_keys=4096) == 64  # 64 keys each
    assert key_splits(1, 16, "cpu", max_keys=16384) == 128
    assert key_splits(8, 16, "cpu") == 16
    assert key_splits(9, 16, "cpu") == 8
    assert key_splits(200, 16, "cpu") == 1
    assert key_splits(1, 64, "cpu") == 64
    assert key_splits(3, 64, "cpu", max_keys=1000) == 4  # ceil(1000 / 256)
    assert key_splits(1, 16, "cpu", max_keys=2500) == 64  # ceil(2500 / 64) = 40, up to 64
    assert key_splits(2, 64, "cpu", max_keys=1300) == 8  # ceil(1300 / 256) = 6, up to 8


def test_every_layout_is_a_variant_the_engine_compiles_at_start() -> None:
    """Whatever batch PagedLayout lays out by default — decode steps, short forwards, prefill
    spans; any request count, new tokens and key lengths, 16 or 128 heads — its (rows per
    block, key splits, in pieces) is one of attention_variants, which the engine compiles when
    it starts: no request waits on a compile (a split count of 40 once compiled its own merge)."""
    from irminsul.kernels import PagedLayout
    from irminsul.kernels.mla_attention import attention_variants

    variants, seen = set(attention_variants()), set()
    rng = np.random.default_rng(0)
    for _ in range(150):
        requests = int(rng.integers(1, 24))
        new = rng.integers(1, int(rng.choice([2, 40, 700])), requests).tolist()
        kv = [np.arange(n + int(rng.integers(0, int(rng.choice([100, 5000]))))) for n in new]
        layout = PagedLayout.build(new, kv, kv, int(rng.choice([16, 128])), "cpu")
        seen.add((layout.block_m, layout.splits, layout.schedule is not None))
    assert seen <= variants, seen - variants
    assert len(seen) >= 6  # the draw reached several kinds of layout


def test_compile_variants_launches_each_and_leaves_the_rows() -> None:
    """The start-up launches run over a pool layer's rows without changing them."""
    from irminsul.kernels.mla_attention import attention_variants, compile_variants

    ckv, kr = torch.randn(80, 128, device=DEVICE), torch.randn(80, 16, device=DEVICE)
    before = ckv.clone(), kr.clone()
    assert compile_variants(ckv, kr, heads=4, scale=0.1) == len(attention_variants())
    assert torch.equal(ckv, before[0]) and torch.equal(kr, before[1])


def test_decode_tiles_step_128_keys_only_for_a_few_splits() -> None:
    from irminsul.kernels import TileConfig

    bf16 = torch.bfloat16
    assert TileConfig.default(16, 512, bf16, splits=16) == TileConfig(128, 512, 8, 2)
    assert TileConfig.default(16, 512, bf16, splits=2) == TileConfig(128, 512, 8, 2)
    assert TileConfig.default(16, 512, bf16, splits=32) == TileConfig(128, 512, 8, 2)  # batch 4
    for splits in (1, 64, 128):  # pieces (1) and batch 1-2's many short splits
        assert TileConfig.default(16, 512, bf16, splits=splits) == TileConfig(64, 512, 8, 2)
    assert TileConfig.default(16, 512, torch.float32, splits=16) == TileConfig(32, 512, 4, 2)
    assert TileConfig.default(64, 512, bf16, splits=16) == TileConfig(32, 512, 8, 1)
