"""The attention sink and the carve-out (paper §7.1, Figure 3, Table 4, Appendix A).

Two measurements at k = 32 (the carve-out's width, ``SINK``):

**Anchoring (W and S by chunk position).** A chunk of ``chunk_tokens`` (128) tokens of real agent
text is placed at absolute position p ∈ {0, 32, 64, 128, 256, 384, 512, 1024, 2048, 3584} after
the first p tokens of a rendered agent prompt (which begins with BOS). For a chunk query at
intra-chunk offset q (absolute p + q), per head and layer:

    W(q) = attention to the chunk's first 32 keys [p, p+32) / attention to the chunk's keys
           [p, p+q]  — the within-chunk first-32 fraction (Figure 3's "sink ratio"; 1 for q < 32
           by causality, so only q >= 32 is read)
    S(q) = attention to absolute keys [0, 32)  — the sequence-start mass

At p = 0 the chunk is the prompt's start (its first token is BOS, then its first 127 tokens), so W
and S coincide, as in the paper. A chunk-start-local sink shows as W far above uniform at every p;
a sequence-start-local one as S far above uniform. Uniform attention would give W = 32/(q+1) and
S = 32/(p+q+1); both are reported (``uniform``), since a model without a sink is near them.
Figure 3's curves are W by q per p (mean over layers and attention heads, ±1 s.d. over samples);
Table 4's cells are W and S averaged over q >= 32, attention heads and samples, per layer, then
mean ±1 s.d. across layers.

**Sink-anchor mass under reuse (the carve-out's effect).** A target prompt is a header (the first
H_t tokens of one rendered agent prompt, 64 <= H_t <= 512: it covers [0, 32)), a body of
``body_tokens`` (256) and a tail of ``tail_tokens`` (32) of other agent text. The body was cached
after another prompt's first H_s tokens (H_s != H_t), so it is reused at δ = H_t − H_s. The tail is
computed on every path, after the same header rows and the body's rows served five ways:

    fresh              the body prefilled in place (the reference: full recomputation)
    pic                the cached body rows, k_r rotated by δ (what Irminsul serves)
    naive              the cached body rows, k_r as cached
    pic_no_carve_out   as pic, and the header's tokens [1, 32) also reused, from a third prompt
                       where they sat after H_c tokens of the body's source prompt (position 0,
                       BOS, is served by the exact prefix on any path); the rest of the header is
                       computed after them.
                       This is what serving without the carve-out would do.
    pic_head           as pic, and the body's first ``repair_head`` (32) tokens computed in place
                       after the header (EPIC-style repair, ``CacheConfig.recompute_head``): the
                       reused run's head, where a run's rows carry most of their source context.
    pic_blend          as pic, and the ``repair_share`` (10%) of the body's tokens whose c_KV at
                       layer ``repair_check_layer`` (1) deviates most from fresh computed in
                       place (CacheBlend-style repair, ``CacheConfig.recompute_share``): in
                       position order, each computed run after every row before it, reused or
                       computed, as the engine serves a plan whose reuse has computed holes.
    pic_recent         as pic, and the same share of the body's tokens, its last ones (those
                       nearest the tail), computed in place after the rest (the recent rule,
                       ``CacheConfig.recompute_rule`` "recent").

The tail-attention mass to [0, 32) (mean over attention heads and tail queries) is taken per layer
and sample; each path's deviation is |mass − mass_fresh|, averaged over layers and samples (the
paper: PIC within 0.003 of fresh, naive 2.4–9× farther).

Reuse runs through :mod:`.reuse` (the engine's δ-rotation by the model's rotary, in torch over
row lists), attention is read by :class:`~.attention.AttentionProbe`.

JSON (``sink.json``): ``study``, ``model``, ``settings``, ``anchoring`` {positions, W, S
(mean over layers per position), W_sd_layers, S_sd_layers, W_per_layer, S_per_layer
([position][layer]), W_by_offset ([position][offset], mean over samples), W_by_offset_sd,
uniform {W, S}}, ``carve_out`` {paths, mass_fresh_per_layer, mass_per_layer {path: [layer]},
deviation {path: mean |mass − fresh|}, deviation_per_layer, deviation_vs_pic {path: ratio},
deltas}, ``paper``, ``seconds``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from ..analysis.report import table
from ..engine.repair import check_layer_fits, most_deviating, nearest_the_end, recompute_at
from ..model import MLAModel
from .attention import AttentionProbe
from .plot import figure, save_png
from .reuse import Rows, joined, moved, prefill
from .text import AgentText

SINK = 32  # k: the carve-out's width
POSITIONS = (0, 32, 64, 128, 256, 384, 512, 1024, 2048, 3584)  # Figure 3 / Table 4's p
HEADER_RANGE = (64, 512)  # header lengths H_t, H_s, H_c are drawn from this range
PATHS = ("pic", "naive", "pic_no_carve_out", "pic_head", "pic_blend", "pic_recent")
PAPER = {"W_mla": {"32": 0.26, "512": 0.24, "3584": 0.23},  # Table 4, DSv2-Lite
         "S_mla": {"32": 0.48, "512": 0.43, "3584": 0.42},
         "deviation_pic_max": 0.003, "naive_over_pic": [2.4, 9.0]}


@dataclass
class SinkSettings:
    samples: int = 4  # chunks per position (anchoring)
    reuse_samples: int = 8  # target prompts (carve-out)
    chunk_tokens: int = 128
    body_tokens: int = 256
    tail_tokens: int = 32
    contexts: int = 2
    seed: int = 0
    positions: tuple[int, ...] = POSITIONS
    repair_head: int = 32  # pic_head: the body's first tokens computed in place (EPIC's k)
    # pic_blend, pic_recent: the share of the body's tokens computed in place
    repair_share: float = 0.10
    repair_check_layer: int = 1  # pic_blend: the layer whose c_KV deviation picks them

    def check(self, layers: int) -> None:
        """Raise on repair settings a model of ``layers`` layers cannot take."""
        check_layer_fits(layers, self.repair_check_layer, "repair_check_layer")
        if self.repair_head < 0:
            raise ValueError(f"repair_head must be >= 0, got {self.repair_head}")
        if not 0.0 <= self.repair_share <= 1.0:
            raise ValueError(f"repair_share must be in [0, 1], got {self.repair_share}")


@dataclass
class Anchoring:
    """Per sample, position, layer and intra-chunk offset (mean over attention heads)."""

    W: np.ndarray  # [samples, positions, layers, chunk_tokens]
    S: np.ndarray  # the same shape


@dataclass
class CarveOut:
    """Tail mass to [0, SINK) per sample and layer, on the fresh path and each reuse path."""

    fresh: np.ndarray  # [samples, layers]
    paths: dict[str, np.ndarray]  # path -> [samples, layers]
    deltas: list[int]

    def deviation(self, path: str) -> float:
        return float(np.abs(self.paths[path] - self.fresh).mean())


@dataclass
class SinkResult:
    model: str
    settings: SinkSettings
    anchoring: Anchoring
    carve_out: CarveOut
    seconds: float = 0.0

    def table(self) -> dict[str, np.ndarray]:
        """Table 4's cells per position and layer: W and S over offsets q >= SINK, attention
        heads and samples."""
        return {name: getattr(self.anchoring, name)[..., SINK:].mean(axis=(0, 3))
                for name in ("W", "S")}

    def uniform(self) -> dict[str, list[float]]:
        """What uniform attention gives for W and S per position (over offsets q >= SINK)."""
        q = np.arange(SINK, self.settings.chunk_tokens)
        return {"W": [float(np.mean(SINK / (q + 1)))] * len(self.settings.positions),
                "S": [float(np.mean(SINK / (p + q + 1))) for p in self.settings.positions]}

    def to_json(self) -> dict:
        cells = self.table()
        w_offset = self.anchoring.W.mean(axis=2)  # [samples, positions, offsets]
        c = self.carve_out
        pic = c.deviation("pic")
        return {
            "study": "sink", "model": self.model, "settings": asdict(self.settings),
            "anchoring": {
                "positions": list(self.settings.positions),
                "W": _round(cells["W"].mean(1)), "S": _round(cells["S"].mean(1)),
                "W_sd_layers": _round(cells["W"].std(1)), "S_sd_layers": _round(cells["S"].std(1)),
                "W_per_layer": _round(cells["W"]), "S_per_layer": _round(cells["S"]),
                "W_by_offset": _round(w_offset.mean(0)), "W_by_offset_sd": _round(w_offset.std(0)),
                "uniform": {k: _round(v) for k, v in self.uniform().items()}},
            "carve_out": {
                "paths": ["fresh", *PATHS],
                "mass_fresh_per_layer": _round(c.fresh.mean(0), 6),
                "mass_per_layer": {p: _round(v.mean(0), 6) for p, v in c.paths.items()},
                "deviation": {p: round(c.deviation(p), 6) for p in PATHS},
                "deviation_per_layer": {p: _round(np.abs(v - c.fresh).mean(0), 6)
                                        for p, v in c.paths.items()},
                "deviation_vs_pic": {p: (round(c.deviation(p) / pic, 2) if pic > 0 else None)
                                     for p in PATHS},
                "deltas": c.deltas},
            "paper": PAPER, "seconds": round(self.seconds, 1)}


def _round(values: np.ndarray | list[float], digits: int = 4) -> list:
    return np.round(np.asarray(values, np.float64), digits).tolist()


def anchoring_sums(start: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """For a chunk whose keys start at ``start``: probabilities [heads, T, start + T] → per
    attention head and query [heads, T, 3]: mass on the chunk's first SINK keys, on the chunk's
    keys, on absolute [0, SINK)."""
    def reduce(p: torch.Tensor) -> torch.Tensor:
        return torch.stack([p[..., start:start + SINK].sum(-1), p[..., start:].sum(-1),
                            p[..., :SINK].sum(-1)], dim=-1)
    return reduce


def sink_mass(p: torch.Tensor) -> torch.Tensor:
    """Probabilities [heads, T, keys] → mass on absolute [0, SINK) per head and query."""
    return p[..., :SINK].sum(-1)


def probe(model: MLAModel, tokens: np.ndarray, start: int, context: Rows | None,
          reduce: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
    """``reduce`` of each layer's attention of ``tokens`` computed at ``start`` after ``context``."""
    with AttentionProbe(model, reduce) as attention:
        prefill(model, tokens, start, context)
    return attention.layers


def anchoring(model: MLAModel, text: AgentText, settings: SinkSettings, chunks: np.ndarray,
              contexts: list[Rows], bos: int) -> Anchoring:
    """W and S of every chunk at every position."""
    layers = model.config.num_hidden_layers
    shape = (len(chunks), len(settings.positions), layers, settings.chunk_tokens)
    w, s = np.zeros(shape), np.zeros(shape)
    for i, chunk in enumerate(chunks):
        rows = contexts[i % len(contexts)]
        for j, p in enumerate(settings.positions):
            tokens = np.r_[bos, chunk[:-1]] if p == 0 else chunk
            context = None if p == 0 else [r[:p] for r in rows]
            for layer, sums in enumerate(probe(model, tokens, p, context, anchoring_sums(p))):
                sums = sums.double().cpu()  # [heads, T, 3]
                # W per head, then the mean over heads (as S): not the pooled heads' ratio.
                w[i, j, layer] = (sums[..., 0] / sums[..., 1]).mean(0).numpy()
                s[i, j, layer] = sums[..., 2].mean(0).numpy()
    return Anchoring(w, s)


def carve_out(model: MLAModel, text: AgentText, settings: SinkSettings, contexts: list[Rows],
              rng: np.random.Generator) -> CarveOut:
    """The tail's mass to [0, SINK) on the fresh path and each reuse path, per sample and layer."""
    settings.check(model.config.num_hidden_layers)
    n = settings.reuse_samples
    pieces = text.pieces(n, settings.body_tokens + settings.tail_tokens, rng)
    fresh, paths, deltas = [], {p: [] for p in PATHS}, []
    for i in range(n):
        body, tail = np.split(pieces[i], [settings.body_tokens])
        h_t, h_s, h_c = (int(h) for h in rng.integers(*HEADER_RANGE, size=3))
        if h_s == h_t:
            h_s += 1  # the body must move
        header_tokens = text.context(i % len(contexts), h_t)
        header = [r[:h_t] for r in contexts[i % len(contexts)]]
        source = prefill(model, body, h_s, [r[:h_s] for r in contexts[(i + 1) % len(contexts)]])
        delta = h_t - h_s
        deltas.append(delta)
        end = h_t + body.size

        def tail_mass(context: Rows, tail: np.ndarray = tail, end: int = end) -> np.ndarray:
            """Per layer, the tail's mass to [0, SINK) after ``context``."""
            layers = probe(model, tail, end, context, sink_mass)
            return np.array([float(m.double().mean()) for m in layers])

        in_place = prefill(model, body, h_t, header)
        fresh.append(tail_mass(joined(header, in_place)))
        served = moved(model, source, delta)  # the body's cached rows, k_r rotated by δ
        paths["pic"].append(tail_mass(joined(header, served)))
        paths["naive"].append(tail_mass(joined(header, moved(model, source, delta, rotate=False))))
        # EPIC-style repair: the run's first k tokens computed after the header, the rest reused.
        k = min(settings.repair_head, body.size)
        head = prefill(model, body[:k], h_t, header) if k else None
        paths["pic_head"].append(tail_mass(joined(header, head, [r[k:] for r in served])))
        # CacheBlend-style repair: the tokens whose c_KV at the check layer deviates most from
        # the fresh rows' (which the engine's check forward computes exactly) computed in place,
        # picked as the engine's recompute_deviating picks them.
        rank, check = model.config.kv_lora_rank, settings.repair_check_layer
        gap = (in_place[check][:, :rank] - served[check][:, :rank]).double().norm(dim=-1)
        picked = most_deviating(gap.numpy(), settings.repair_share)
        paths["pic_blend"].append(tail_mass(blended(model, body, h_t, header, served, picked)))
        # The recent rule: the same share, the body's tokens nearest the tail, picked by the
        # engine's ranking.
        offsets = np.arange(body.size)
        last = most_deviating(nearest_the_end(body, offsets, offsets), settings.repair_share)
        paths["pic_recent"].append(tail_mass(blended(model, body, h_t, header, served, last)))
        # Without the carve-out: header tokens [1, SINK) come from a prompt where they followed
        # h_c other tokens, rotated into place; the rest of the header is computed after them.
        other = [r[:h_c] for r in contexts[(i + 1) % len(contexts)]]
        first = moved(model, prefill(model, header_tokens[1:SINK], h_c, other), 1 - h_c)
        start = joined([r[:1] for r in header], first)
        rest = prefill(model, header_tokens[SINK:], SINK, start)
        paths["pic_no_carve_out"].append(tail_mass(joined(start, rest, served)))
    return CarveOut(np.array(fresh), {p: np.array(v) for p, v in paths.items()}, deltas)


def blended(model: MLAModel, body: np.ndarray, start: int, header: Rows, served: Rows,
            picked: np.ndarray) -> Rows:
    """The header's rows, then the body's: served rows except at the body offsets ``picked``,
    computed in place there — split into runs as the engine splits a reuse stretch
    (``recompute_at``), each computed run after every row before it."""
    rows = header
    for kind, a, b, _ in recompute_at([["reuse", 0, body.size, []]], picked):
        part = (prefill(model, body[a:b], start + a, rows) if kind == "compute"
                else [r[a:b] for r in served])
        rows = joined(rows, part)
    return rows


def sink_study(model: MLAModel, text: AgentText, bos: int, settings: SinkSettings | None = None,
               *, model_name: str = "") -> SinkResult:
    """Run both measurements; ``bos`` is the token every prompt begins with."""
    settings = settings or SinkSettings()
    settings.check(model.config.num_hidden_layers)  # before the anchoring's work
    started = time.perf_counter()
    rng = np.random.default_rng(settings.seed)
    longest = max(max(settings.positions), HEADER_RANGE[1])
    contexts = [prefill(model, text.context(i, longest), 0) for i in range(settings.contexts)]
    chunks = text.pieces(settings.samples, settings.chunk_tokens, rng)
    result = SinkResult(model_name, settings,
                        anchoring(model, text, settings, chunks, contexts, bos),
                        carve_out(model, text, settings, contexts, rng))
    result.seconds = time.perf_counter() - started
    return result


def plot_sink(result: SinkResult, path: Path) -> None:
    """Figure 3 (W by intra-chunk offset per position), Figure 5 / Table 4 (W and S by position)
    and the carve-out's tail-mass deviation per layer."""
    fig, (fig3, fig5, dev) = figure(3)
    report = result.to_json()
    a, c = report["anchoring"], report["carve_out"]
    positions = a["positions"]
    colours = matplotlib_colours(len(positions))
    offsets = np.arange(result.settings.chunk_tokens)
    for j, p in enumerate(positions):
        mean, sd = np.array(a["W_by_offset"][j]), np.array(a["W_by_offset_sd"][j])
        fig3.plot(offsets, mean, color=colours[j], lw=1, label=f"p={p}")
        fig3.fill_between(offsets, mean - sd, mean + sd, color=colours[j], alpha=0.15, lw=0)
    fig3.plot(offsets[SINK:], SINK / (offsets[SINK:] + 1), "k:", lw=1, label="uniform")
    fig3.axvspan(0, SINK, color="0.9")
    fig3.set_xlabel("intra-chunk query offset q")
    fig3.set_ylabel(f"W: within-chunk first-{SINK} fraction")
    fig3.set_ylim(0, 1.02)
    fig3.legend(fontsize=6, ncol=2)
    x = np.arange(len(positions))
    for name, colour in (("W", "#C44E52"), ("S", "#4C72B0")):
        mean, sd = np.array(a[name]), np.array(a[f"{name}_sd_layers"])
        fig5.errorbar(x, mean, yerr=sd, color=colour, marker="o", capsize=2, label=name)
        fig5.plot(x, a["uniform"][name], ":", color=colour, label=f"{name} uniform")
    fig5.set_xticks(x, [str(p) for p in positions], fontsize=7)
    fig5.set_xlabel("chunk absolute position p")
    fig5.set_ylabel(f"attention mass at k={SINK} (±1 s.d. across layers)")
    fig5.set_ylim(0, 1.02)
    fig5.legend(fontsize=7)
    layers = np.arange(len(c["mass_fresh_per_layer"]))
    width = 0.8 / len(PATHS)
    for k, name in enumerate(PATHS):
        dev.bar(layers + (k - (len(PATHS) - 1) / 2) * width, c["deviation_per_layer"][name], width,
                label=f"{name} (mean {c['deviation'][name]:.2g})")
    dev.axhline(PAPER["deviation_pic_max"], color="k", ls="--", lw=0.8, label="paper: PIC ≤ 0.003")
    dev.set_xticks(layers)
    dev.set_xlabel("layer")
    dev.set_ylabel(f"|tail mass to [0,{SINK}) − fresh|")
    dev.legend(fontsize=7)
    fig.suptitle(f"Attention sink ({result.model}): anchoring by chunk position, and the "
                 "sink-anchor mass under reuse", fontsize=9)
    save_png(fig, path)


def matplotlib_colours(n: int) -> list:
    """Red at p = 0, warm for the short positions, cool for the long ones (as Figure 3)."""
    import matplotlib

    return [matplotlib.colormaps["coolwarm_r"](i / max(1, n - 1)) for i in range(n)]


def render_sink(result: SinkResult) -> str:
    """Table 4 (W and S by position, with uniform attention's values) and the carve-out's
    tail-mass deviations."""
    report = result.to_json()
    a, c = report["anchoring"], report["carve_out"]
    rows = [[str(p), f"{a['W'][j]:.3f} ± {a['W_sd_layers'][j]:.3f}", f"{a['uniform']['W'][j]:.3f}",
             f"{a['S'][j]:.3f} ± {a['S_sd_layers'][j]:.3f}", f"{a['uniform']['S'][j]:.3f}"]
            for j, p in enumerate(a["positions"])]
    anchoring = table(f"Sink anchoring at k={SINK} by chunk position (W: within-chunk first-{SINK} "
                      f"fraction, S: absolute [0, {SINK}) mass; mean ± s.d. across layers; "
                      "uniform: what attention spread evenly would give)",
                      ["position", "W", "W uniform", "S", "S uniform"], rows)
    fresh = float(np.mean(c["mass_fresh_per_layer"]))
    rows = [["fresh", f"{fresh:.4f}", "0", "—"]]
    for path in PATHS:
        ratio = c["deviation_vs_pic"][path]
        rows.append([path, f"{float(np.mean(c['mass_per_layer'][path])):.4f}",
                     f"{c['deviation'][path]:.2g}", "—" if ratio is None else f"{ratio:.2f}x"])
    carve = table(f"Tail-attention mass to [0, {SINK}) under reuse ({result.settings.reuse_samples} "
                  "prompts; deviation: mean |mass − fresh| over layers and prompts; paper: PIC "
                  "≤ 0.003, naive 2.4–9x farther)",
                  ["path", f"mass to [0,{SINK})", "deviation", "vs pic"], rows)
    return f"{anchoring}\n\n{carve}"
