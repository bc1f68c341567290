"""Every default in one place: how the cache plans, how the engine runs, how the server listens.

Python callers build these and pass them down; the CLI builds them from its flags, so ``--help``
shows each default once, taken from here. Each layer takes the config of its own concern:

    CacheConfig    the planner (chunking, carve-out, probes, regions, index capacity)
    EngineConfig   the engine (cache mode, KV slots, batch budgets, kernels, graphs) + its cache
    ParallelConfig one engine over several GPUs (ranks, collective backend, failure timeout)
    GateConfig     the PIC correctness gate (thresholds, probe continuation, result cache)
    ServerConfig   the HTTP server (address, model name, dtype, device) + its engine and gate
    StoreConfig    the shared content store a server publishes to and fetches from (Redis)
    RouterConfig   the router in front of several servers (backends, policy, score, polling)

``ALGORITHM1`` is the paper's Algorithm 1 exactly (no head probe, no regions, 128-token S1 windows
without extension): ``analyze`` replays it as a named strategy beside the engine's default, which
adds the probes beyond it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Mode = Literal["off", "observer", "live"]
MODES: tuple[Mode, ...] = ("off", "observer", "live")


@dataclass(frozen=True)
class CacheConfig:
    """How a prompt is planned (Algorithm 1 and the probes beyond it)."""

    mask_bits: int = 7  # a chunk ends where the Gear hash's low bits are zero: ~128-token chunks
    min_chunk: int = 32
    max_chunk: int = 512
    carve_out: int = 32  # nothing is reused below this position (the attention sink)
    s1: bool = True  # a missed chunk probes its s1_window-token sub-windows
    # Registered at a stride of their width: with 32, any repeated stretch of 63 tokens or more
    # holds a registered window (the paper's 128 misses stretches under 255 tokens, and most
    # repeats inside otherwise new messages are shorter: benchmarks/cpu/planner_options.py).
    s1_window: int = 32
    # A window hit grows token by token both ways, as far as the prompt and the registered chunk
    # go on repeating each other, and consecutive missed chunks are probed as one range: a
    # repeated stretch shorter than a chunk, or cut by a chunk boundary, is found whole.
    s1_extend: bool = True
    # A missed chunk reuses the most leading tokens it shares with a registered chunk that
    # starts with the same HEAD_TOKENS (a prompt's last chunk is cut where the prompt ends, so
    # it rarely matches whole).
    head_probe: bool = True
    # Each region (tokens between two resets) is looked up whole first, and a region found is
    # run on along the run of regions it was registered with: a moved document is one hit.
    regions: bool = True
    capacity: int | None = None  # tokens per index (radix tree, registry), LRU; None: unbounded
    # Repair (live): the first this many tokens of every reused run are computed instead of
    # reused, EPIC-style (benchmarks/cpu/repair.py measures KL and argmax against it).
    recompute_head: int = 0
    # Repair (live), CacheBlend-style on the latent: this share of a prompt's reused tokens, those
    # whose c_KV at layer recompute_check_layer deviates most from a fresh computation (a check
    # forward of the prompt through the layers below it), is computed instead of reused
    # (irminsul/engine/repair.py; benchmarks/cpu/repair.py measures it).
    recompute_share: float = 0.0
    # Layer 1 is the first whose c_KV depends on context (layer 0's rows are the token's own),
    # and the cheapest check: one layer of a fresh prefill.
    recompute_check_layer: int = 1
    # How recompute_share's tokens are picked. "deviation": the largest c_KV deviations at the
    # check layer (CacheBlend's criterion). "signed": the largest first-order drops of the
    # error in the prompt tail's attention output at layers 1 .. recompute_check_layer when a
    # token's fresh c_KV replaces its cached one: reused tokens' errors partly offset each
    # other, and recomputing one whose error offsets others' raises the output's error, which
    # a deviation's size cannot tell (docs/quality.md: sysvar 1.29x KL at 10% by deviation).
    # "recent": the reused tokens nearest the prompt's end, those the tail and the reply attend
    # to at the shortest distance; no check forward (recompute_check_layer unused).
    recompute_rule: str = "deviation"
    # Repair's cap (0: none): at most this share of a prompt's reused tokens is computed, heads
    # and share together. The share's tokens are kept and recompute_head shrinks, per prompt, to
    # the largest k whose heads fit in what is left: where a prompt is many short reused runs
    # (re-ranked documents) k tokens of each would compute far more than the share.
    recompute_budget: float = 0.0
    # Heal (live): a finished sequence that was served reused rows is queued, and when the
    # engine is idle its rows from the first reused one on are computed again over the exact
    # rows before them and replace the reused ones in both indexes. A later turn then matches
    # an exact prefix, and chunks registered from that sequence are a full prefill's rows:
    # reuse errors do not compound from turn to turn (rerank's KL 0.022 -> 0.015 in the
    # consistency study). Off by default: it spends the compute reuse saved, and under load
    # there is little idle time to spend (an H200 serving rerank sessions 4 at a time with 0.5 s
    # of think time: 3.4 against 5.1 requests/s; docs/quality.md). Up to heal_queue sequences
    # wait, the newest healed first.
    heal: bool = False
    heal_queue: int = 64

    def __post_init__(self) -> None:
        if self.recompute_head < 0:
            raise ValueError(f"recompute_head must be >= 0, got {self.recompute_head}")
        if not 0.0 <= self.recompute_share <= 1.0:
            raise ValueError(f"recompute_share must be in [0, 1], got {self.recompute_share}")
        if not 0.0 <= self.recompute_budget <= 1.0:
            raise ValueError(f"recompute_budget must be in [0, 1], got {self.recompute_budget}")
        if self.recompute_budget and self.recompute_budget < self.recompute_share:
            raise ValueError(f"recompute_budget ({self.recompute_budget}) is below "
                             f"recompute_share ({self.recompute_share}): the share alone "
                             "would exceed it")
        if self.heal_queue < 1:
            raise ValueError(f"heal_queue must be >= 1, got {self.heal_queue}")
        if self.recompute_rule not in ("deviation", "signed", "recent"):
            raise ValueError(f"recompute_rule must be 'deviation', 'signed' or 'recent', got "
                             f"{self.recompute_rule!r}")
        if self.recompute_check_layer < 1:
            raise ValueError(f"recompute_check_layer must be >= 1, got "
                             f"{self.recompute_check_layer}")
        if not 1 <= self.mask_bits <= 30:
            raise ValueError(f"mask_bits must be in [1, 30], got {self.mask_bits}")
        if not 1 <= self.min_chunk <= self.max_chunk:
            raise ValueError(f"need 1 <= min_chunk <= max_chunk, got {self.min_chunk} and "
                             f"{self.max_chunk}")
        if self.carve_out < 0 or self.s1_window < 1 or self.s1_window & (self.s1_window - 1):
            raise ValueError(f"carve_out must be >= 0 and s1_window a power of two, got "
                             f"{self.carve_out} and {self.s1_window}")
        if self.capacity is not None and self.capacity < 1:
            raise ValueError(f"capacity must be >= 1 token or None, got {self.capacity}")


MAX_DEFAULT_SLOTS = 1 << 16  # 64K tokens: ~2 GB of latent rows for DeepSeek-V2-Lite in bf16


def default_slots(context: int) -> int:
    """The KV pool's default size: a few full-context requests, capped for long contexts."""
    return min(4 * context, MAX_DEFAULT_SLOTS)


# The paper's Algorithm 1 (analyze replays it beside the engine's default).
ALGORITHM1 = CacheConfig(head_probe=False, regions=False, s1_window=128, s1_extend=False)
# Tokens each index of analyze's replay holds: ~124 GB of DeepSeek-V2-Lite KV (27 × 576 × bf16).
REPLAY_CAPACITY = 4_000_000


@dataclass(frozen=True)
class EngineConfig:
    """How the engine serves: cache mode, KV pool, batching, and what runs the forward."""

    mode: Mode = "live"  # off: exact prefix only; observer: record would-be hits; live: serve
    slots: int | None = None  # c_KV slots (tokens; None: default_slots of the model's context)
    kr_slots: int | None = None  # k_r slots (None: as many as c_KV); 1/9 of a c_KV row each
    # Tokens per forward (decode tokens first, then prefill spans) and prompt tokens one request
    # prefills per forward. SGLang's chunked prefill and mini-sglang default to 8192 on an H200
    # class GPU; 512 / 2048 here ran a 16K prompt in 32 forwards, 5x its one-forward prefill, and
    # left PIC off's sessions 2.5x slower under load (docs/performance.md, chunked prefill).
    batch_tokens: int = 8192
    chunk_tokens: int = 8192
    # Requests admitted at once (None: no cap but the pool's room and batch_tokens, since every
    # running request decodes a token in every step)
    max_running: int | None = None
    # A request whose plan would compute at least this many tokens of chunks that prefills in
    # flight are computing waits for them to register those chunks, then reuses them (0: never)
    await_shared: int = 256
    # Live mode: this share of the requests PIC served is recomputed from scratch when the
    # engine is idle and KL(full ‖ served) of the first token exported (irminsul:pic_audit_kl).
    pic_audit_rate: float = 0.01
    # Idle work (the audit's recomputations, heals) starts once the engine has had nothing to do
    # for this long: the gap between a reply and the same agent's next call, sent back to back,
    # is a few ms, and idle work started there would only delay that call.
    idle_delay_s: float = 0.1
    # Live mode with the cache's heal on: tokens one idle forward heals (a request that arrives
    # meanwhile waits for at most one such forward)
    heal_tokens: int = 1024
    kernels: bool | None = None  # Triton kernels (None: on CUDA when triton is installed)
    graphs: bool | None = None  # CUDA graphs for short spans (None: with kernels, bf16 models)
    cache: CacheConfig = field(default_factory=CacheConfig)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown cache mode {self.mode!r}; choose from {', '.join(MODES)}")
        for name in ("slots", "kr_slots"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 (leave it out for the default), got "
                                 f"{value}")
        if not 0 <= self.pic_audit_rate <= 1:
            raise ValueError(f"pic_audit_rate must be in [0, 1], got {self.pic_audit_rate}")
        if self.idle_delay_s < 0:
            raise ValueError(f"idle_delay_s must be >= 0, got {self.idle_delay_s}")
        if self.heal_tokens < 1:
            raise ValueError(f"heal_tokens must be >= 1, got {self.heal_tokens}")
        if self.await_shared < 0:
            raise ValueError(f"await_shared must be >= 0, got {self.await_shared}")
        if min(self.batch_tokens, self.chunk_tokens, self.max_running or 1) < 1:
            raise ValueError(f"batch_tokens, chunk_tokens and max_running must be >= 1, got "
                             f"{self.batch_tokens}, {self.chunk_tokens}, {self.max_running}")
        if self.graphs and self.kernels is False:
            raise ValueError("graphs replay the kernel path: they need kernels")


ParallelBackend = Literal["nccl", "gloo"]
# How attention splits over the ranks: "tensor", each rank its heads of every request (one cache,
# replicated); "data", each rank every head of its own requests (a cache per rank).
AttentionMode = Literal["tensor", "data"]
ATTENTION_MODES: tuple[AttentionMode, ...] = ("tensor", "data")


@dataclass(frozen=True)
class ParallelConfig:
    """Several processes, one per GPU (:mod:`irminsul.parallel`), routed experts divided among
    them. Tensor-parallel attention: one engine, attention heads and dense MLPs split across the
    ranks. Data-parallel attention: an engine per rank, each with its own requests, every head
    and dense layer on every rank, their MoE layers in lockstep."""

    world_size: int = 1  # ranks (GPUs); 1: no process group at all
    attention: AttentionMode = "tensor"
    backend: ParallelBackend | None = None  # None: nccl on CUDA, gloo elsewhere
    # A collective that waits longer than this for a peer fails with RankFailure: a rank that
    # died or hung stops the others with an error instead of a hang.
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.attention not in ATTENTION_MODES:
            raise ValueError(f"unknown attention split {self.attention!r}; choose from "
                             f"{', '.join(ATTENTION_MODES)}")
        if self.backend not in (None, "nccl", "gloo"):
            raise ValueError(f"unknown backend {self.backend!r}; choose from nccl, gloo")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")


@dataclass(frozen=True)
class StoreConfig:
    """The shared content store (``irminsul serve --store redis://HOST:PORT``): engines publish
    the chunks they register, and fetch the ones they miss instead of prefilling them when
    that is faster (:mod:`irminsul.store`). The store's memory cap is the Redis server's own
    (``maxmemory`` with ``maxmemory-policy allkeys-lru``); each value also expires after
    ``ttl_s``."""

    url: str | None = None  # redis://HOST:PORT[/DB]; None: no shared store
    # Each socket operation (connect, send, a read): past it the store counts as down for that
    # call, and the request is served as if the store were empty.
    timeout_s: float = 0.1
    # Consecutive failed calls that open the circuit breaker; an open breaker refuses calls at
    # once (no socket, no timeout) for cooldown_s, then lets one call through to try again.
    breaker_failures: int = 3
    breaker_cooldown_s: float = 5.0
    ttl_s: int = 24 * 3600  # a published value's time to live (refreshed when published again)
    max_value_bytes: int = 64 << 20  # larger chunk values are not published
    # The cost model: rows are fetched when bytes / bandwidth + a round trip beats prefilling
    # them at this rate. The bandwidth (bytes/s) starts here and follows what fetches measure;
    # the prefill rate is the deployment's (tokens/s of a long prefill on its hardware).
    link_bandwidth: float = 1.25e9
    prefill_tokens_per_second: float = 20_000.0
    publish_queue_bytes: int = 256 << 20  # rows waiting to be published; more are dropped
    # The model's identity in keys (None: a fingerprint of the config, the KV dtype and a
    # sample of every weight): engines share values only with the same identity.
    model_id: str | None = None

    def __post_init__(self) -> None:
        if self.url is not None and not self.url.startswith(("redis://", "rediss://",
                                                             "unix://")):
            raise ValueError(f"store url must be redis://HOST:PORT (or rediss://, unix://), got "
                             f"{self.url!r}")
        for name in ("timeout_s", "breaker_cooldown_s", "link_bandwidth",
                     "prefill_tokens_per_second"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("breaker_failures", "ttl_s", "max_value_bytes", "publish_queue_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class GateConfig:
    """The PIC correctness gate (``irminsul gate``, and every live server's start): its probes'
    continuation length, the thresholds live reuse must meet, and where results are cached.

    The figures are the gate's means over its probes (irminsul/quality/probes.py) of
    KL(p_full || p_pic) per continuation token and PIC's argmax match with full recomputation's
    greedy continuation (docs/quality.md says how each is measured).
    """

    # KL(full || PIC) in nats per token, at most. The public SGLang port of this design gates on
    # 0.02 and measured 0.0030 (DeepSeek-V2-Lite) and 0.0019 (Moonlight): a checkpoint served as
    # the design intends sits an order of magnitude below it, a broken rotation far above.
    max_kl: float = 0.02
    # KL(full || PIC) must be below KL(full || naive), naive reuse keeping k_r unrotated: where
    # rotating by δ is no better than not rotating, the rotation does not match what the model
    # computes (a wrong sign, layout or frequency), whatever the absolute figure.
    below_naive: bool = True
    # PIC's argmax must match full recomputation's greedy token at this share of the steps, at
    # least. Greedy output is what users see; a small model's flat distributions flip the argmax
    # at near-ties with little KL, so this guards against a few confident flips, not noise.
    min_argmax: float = 0.9
    tokens: int = 8  # continuation tokens per probe: the gate runs in seconds on a CPU
    # Results are kept per checkpoint hash here; None: $XDG_CACHE_HOME/irminsul/gate
    # (~/.cache/irminsul/gate without XDG_CACHE_HOME).
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        if not self.max_kl >= 0 or not 0 <= self.min_argmax <= 1:
            raise ValueError(f"need max_kl >= 0 and min_argmax in [0, 1], got {self.max_kl} and "
                             f"{self.min_argmax}")
        if self.tokens < 1:
            raise ValueError(f"the gate needs at least one continuation token, got {self.tokens}")


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP server and the engine behind it."""

    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str | None = None  # the name clients send (None: the model directory's name)
    dtype: str = "auto"  # weights and KV (auto: bfloat16 on CUDA, else float32)
    device: str | None = None  # torch device (None: cuda when available, else cpu)
    # An FP8 block-quantized checkpoint's linear and expert weights stay float8 with their scales
    # (half of bf16's bytes: DeepSeek-V3 fits 8 GPUs only so), dequantized per use; False:
    # dequantized at load.
    keep_fp8: bool = False
    default_max_tokens: int = 1024  # a chat request without max_tokens: this, or what fits
    # A request body larger than this is refused (413) before it is parsed; None: sized for the
    # model's context (request_bytes_for).
    max_request_bytes: int | None = None
    # Requests waiting for their first token beyond the engine's max_running; more get 429.
    max_waiting: int = 1024
    # A request's body not all received in this many seconds gets 408: a stalled upload gives
    # back its place among the waiting (taken before the body, which bounds the bodies held).
    body_timeout_s: float = 30.0
    render_workers: int = 4  # threads that parse, render and tokenise requests off the event loop
    render_memo_bytes: int = 256 << 20  # rendered messages kept for the next turn, LRU
    # On CUDA with engine.slots None: the KV pool takes this share of the GPU memory left once
    # the weights are loaded (the rest: activations, CUDA graphs, logits).
    kv_memory: float = 0.85
    # Before serving, run a few synthetic requests through the engine (kernels compiled,
    # attention planned for the paths long prompts, PIC and sampling take), then empty its
    # cache (irminsul.engine.warmup); None: on CUDA, where a cold path costs seconds.
    warmup: bool | None = None
    engine: EngineConfig = field(default_factory=EngineConfig)
    # Live PIC is served only if the gate passes (else exact prefixes only); None: no gate
    # (the operator's override, logged as a warning).
    gate: GateConfig | None = field(default_factory=GateConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    # GET /irminsul/index answers only requests carrying "Authorization: Bearer <index_token>"
    # (the routers'; 401 otherwise). None: whoever reaches the server reads it, and with it can
    # test whether unsalted content (its namespace is the model name's) is cached.
    index_token: str | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.index_token is not None and not self.index_token:
            raise ValueError("index_token must not be empty")
        if not 0 < self.kv_memory < 1:
            raise ValueError(f"kv_memory must be in (0, 1), got {self.kv_memory}")
        if not self.body_timeout_s > 0:
            raise ValueError(f"body_timeout_s must be > 0, got {self.body_timeout_s}")
        for name in ("max_request_bytes", "max_waiting", "render_workers", "render_memo_bytes",
                     "default_max_tokens"):
            value, least = getattr(self, name), 0 if name == "max_waiting" else 1
            if value is not None and value < least:
                raise ValueError(f"{name} must be >= {least}, got {value}")

    def request_bytes_for(self, context: int) -> int:
        """The body-size limit: ``max_request_bytes``, or by default 1 MiB plus 32 bytes per
        token of context (JSON-escaped text of a full context, with room for the rest)."""
        if self.max_request_bytes is not None:
            return self.max_request_bytes
        return (1 << 20) + 32 * context


RoutingPolicy = Literal["content", "prefix", "round_robin"]
ROUTING_POLICIES: tuple[RoutingPolicy, ...] = ("content", "prefix", "round_robin")


@dataclass(frozen=True)
class RouterConfig:
    """The router (``irminsul router --backend URL ...``): an OpenAI-compatible proxy that sends
    each request to the backend whose cache holds most of its tokens, balanced by load
    (:mod:`irminsul.router`; docs/scale-out.md gives the score).

    A backend's score for a request of n prompt tokens is
    ``cached / n - queue_weight * queue - kv_weight * kv_usage``: ``cached`` the tokens its
    published index (plus what this router sent it since) would serve, ``queue`` its requests
    in flight, ``kv_usage`` its KV pool's share in use. Scores within ``tie_margin`` of the best
    tie: the session's last backend wins them, else a hash of the session (or prompt)."""

    backends: tuple[str, ...] = ()  # base URLs, http://HOST:PORT
    host: str = "127.0.0.1"
    port: int = 8080
    # content: exact prefix, then chunks; prefix: exact prefix only; round_robin: in turn
    policy: RoutingPolicy = "content"
    # One request more in flight costs what 2% of the prompt served from cache gains: on a busy
    # backend a request waits for the others' prefills.
    queue_weight: float = 0.02
    kv_weight: float = 0.05  # a full KV pool costs what 5% of the prompt served gains
    tie_margin: float = 0.01  # scores this close to the best tie
    session_header: str = "x-session-id"  # or the body's "user": requests of one session
    sessions: int = 65_536  # sessions whose last backend is remembered, LRU
    poll_interval_s: float = 0.5  # each backend's index is polled this often
    timeout_s: float = 2.0  # an index poll, and connecting to a backend (not a reply's wait)
    # A poll that connects but is not answered within timeout_s is a busy backend's (the server
    # reads its index between engine steps, after a long prefill's): the backend keeps its last
    # index and load and stays up until this many polls in a row time out.
    poll_timeouts: int = 3
    # A backend that refused a connection or failed a poll (poll_timeouts in a row, for time-outs)
    # is skipped for backoff_s, doubled on each further failure up to backoff_max_s; then polled
    # again.
    backoff_s: float = 1.0
    backoff_max_s: float = 30.0
    # Requests sent to a backend whose content its published index does not show yet (their
    # prefill may still run): counted as cached there until a poll after they end. Most kept:
    routed: int = 4096
    max_request_bytes: int = 64 << 20  # larger bodies get 413 before they are read whole
    body_timeout_s: float = 30.0  # a body not all received by then gets 408
    render_workers: int = 4  # threads that render and chunk requests off the event loop
    render_memo_bytes: int = 256 << 20  # rendered messages kept for the next turn, LRU
    index_token: str | None = None  # sent to backends' /irminsul/index (ServerConfig's)

    def __post_init__(self) -> None:
        if self.policy not in ROUTING_POLICIES:
            raise ValueError(f"unknown routing policy {self.policy!r}; choose from "
                             f"{', '.join(ROUTING_POLICIES)}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        for url in self.backends:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"backend URL must be http://HOST:PORT, got {url!r}")
        # The router strips a trailing slash: "http://a/" is "http://a".
        if len({url.rstrip("/") for url in self.backends}) != len(self.backends):
            raise ValueError(f"a backend is given twice: {', '.join(self.backends)}")
        for name in ("queue_weight", "kv_weight", "tie_margin"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("poll_interval_s", "timeout_s", "backoff_s", "backoff_max_s",
                     "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.backoff_max_s < self.backoff_s:
            raise ValueError(f"backoff_max_s ({self.backoff_max_s}) must be >= backoff_s "
                             f"({self.backoff_s})")
        for name in ("poll_timeouts", "sessions", "routed", "max_request_bytes",
                     "render_workers", "render_memo_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
