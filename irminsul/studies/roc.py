"""Position invariance of the cache row's parts (paper §5, Figure 2, Appendix F): threshold-free AUC.

Is a cached vector still the same content's vector at another position? Content blocks are placed
at the paper's five slots {0, 512, 1024, 2048, 3584} of a 4,096-token window and each block
token's per-layer cache row is captured. A *positive* pair is one block token at two slots (same
content, different positions); a *negative* pair is that token offset in two different blocks,
each at a slot drawn uniformly at random (different content, randomised positions — the
conservative choice, Appendix F). Each pair is scored by cosine similarity; the AUC is the
probability that a positive outscores a negative (ties count half): 1 separates content
perfectly, 0.5 is chance, below 0.5 position noise outweighs content and reusing the vector
unchanged is worse than chance. Components, per layer:

    c_KV        the position-free latent (kv_lora_rank dims; paper: AUC 0.77)
    k_r         the RoPE key as cached, rotated to its position (paper: 0.43)
    row         the whole cache row [c_KV | k_r] (the paper's 576-dim control, ~0.5)
    k_r_rotated k_r of the pair's first copy rotated by δ to the second's slot, as PIC serves it
                (not in the paper: what the δ-rotation gives back)

Choices where the paper is silent (documented in docs/studies.md):

* A *block* is ``block_tokens`` (32) consecutive tokens of real agent text: a piece of the
  distinct rendered messages of the shipped samples (:mod:`.text`); every token of a block is
  scored, so one block at five slots gives 10 positive pairs per token.
* What precedes a slot is real agent text too: the first p tokens of a rendered agent prompt (a
  *context*, starting with BOS). Block b at slot j follows context (b + j) mod ``contexts``, so a
  block's copies follow different text, as reused content does in serving. Position 0 holds the
  BOS token in every window, so slot 0 places the block at position 1.
* One negative pair is drawn per positive pair (same token offset, another block, both slots
  random), so the two classes are the same size.

The paper's size is 500 blocks; ``blocks`` defaults smaller to run in about a minute on two CPU
cores with the embedded model (``irminsul study roc --blocks 500`` for the paper's).

JSON (``roc.json``): ``study``, ``model``, ``settings`` {blocks, block_tokens, slots, positions,
contexts, seed}, ``pairs`` {positive, negative} (per layer and component), ``components``,
``auc_per_layer`` {component: [layer AUCs]}, ``auc_mean`` {component: mean over layers},
``paper`` {component: the paper's AUC}, ``seconds``.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..analysis.report import table
from ..model import MLAModel
from .plot import figure, save_png
from .reuse import prefill
from .text import AgentText

SLOTS = (0, 512, 1024, 2048, 3584)  # the paper's five absolute positions in a 4,096-token window
COMPONENTS = ("c_KV", "k_r", "row", "k_r_rotated")
PAPER_AUC = {"c_KV": 0.77, "k_r": 0.43, "row": 0.5}  # Figure 2 (the row: "near 0.5")
BATCH = 16  # blocks per forward at one slot


@dataclass
class RocSettings:
    blocks: int = 32
    block_tokens: int = 32
    contexts: int = 2
    seed: int = 0
    slots: tuple[int, ...] = SLOTS

    @property
    def positions(self) -> list[int]:
        """Where each slot's block starts: position 0 is BOS, so slot 0 starts at 1."""
        return [max(slot, 1) for slot in self.slots]


@dataclass
class RocResult:
    """AUC of each component per layer (``auc[component][layer]``)."""

    model: str
    settings: RocSettings
    positive_pairs: int
    negative_pairs: int
    auc: dict[str, list[float]] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def auc_mean(self) -> dict[str, float]:
        return {name: float(np.mean(values)) for name, values in self.auc.items()}

    def to_json(self) -> dict:
        settings = asdict(self.settings) | {"positions": self.settings.positions}
        return {"study": "roc", "model": self.model, "settings": settings,
                "pairs": {"positive": self.positive_pairs, "negative": self.negative_pairs},
                "components": list(COMPONENTS),
                "auc_per_layer": {k: [round(v, 4) for v in vs] for k, vs in self.auc.items()},
                "auc_mean": {k: round(v, 4) for k, v in self.auc_mean.items()},
                "paper": PAPER_AUC, "seconds": round(self.seconds, 1)}


def auc(positive: np.ndarray, negative: np.ndarray) -> float:
    """P(a positive score > a negative score) + ½ P(equal): the Mann–Whitney U over the two
    classes' sizes, from the ranks of the pooled scores (ties get their average rank)."""
    positive, negative = np.asarray(positive, np.float64), np.asarray(negative, np.float64)
    if positive.size == 0 or negative.size == 0:
        raise ValueError("AUC needs at least one positive and one negative score")
    pooled = np.concatenate([positive, negative])
    order = np.argsort(pooled, kind="mergesort")
    ordered = pooled[order]
    ranks = np.empty(pooled.size, np.float64)
    # Average rank of each run of equal scores: ranks are 1-based, a run [i, j) gets (i+1+j)/2.
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    ends = np.r_[starts[1:], pooled.size]
    ranks[order] = np.repeat((starts + 1 + ends) / 2.0, ends - starts)
    u = ranks[:positive.size].sum() - positive.size * (positive.size + 1) / 2.0
    return float(u / (positive.size * negative.size))


def cosine(a: torch.Tensor, b: torch.Tensor) -> np.ndarray:
    """Row-wise cosine similarity of two [n, d] tensors, float64."""
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1).numpy()


def capture(model: MLAModel, text: AgentText, settings: RocSettings,
            blocks: np.ndarray) -> list[torch.Tensor]:
    """Per layer, float32 [blocks, slots, block_tokens, L+R]: each block's rows at each slot."""
    positions = settings.positions
    contexts = [prefill(model, text.context(i, positions[-1]), 0)
                for i in range(settings.contexts)]
    layers = model.config.num_hidden_layers
    out = [torch.empty(len(blocks), len(positions), blocks.shape[1],
                       model.config.kv_lora_rank + model.config.qk_rope_head_dim)
           for _ in range(layers)]
    for j, start in enumerate(positions):
        for first in range(0, len(blocks), BATCH):
            batch = range(first, min(first + BATCH, len(blocks)))
            ids = [torch.from_numpy(blocks[b]) for b in batch]
            where = [torch.arange(start, start + blocks.shape[1]) for _ in batch]
            ctx = [[rows[:start] for rows in contexts[(b + j) % settings.contexts]]
                   for b in batch]
            for b, result in zip(batch, model.forward_batch(ids, where, ctx)):
                for layer in range(layers):
                    out[layer][b, j] = result.latents[layer].float().cpu()
    return out


def pairs(blocks: int, slots: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Positive (block, slot_a, block, slot_b) index rows — every block, every two slots — and as
    many negatives: another block, both slots uniformly at random."""
    a, b = np.triu_indices(slots, k=1)
    block = np.repeat(np.arange(blocks), a.size)
    positive = np.stack([block, np.tile(a, blocks), block, np.tile(b, blocks)], axis=1)
    other = (block + rng.integers(1, blocks, size=block.size)) % blocks  # never the same block
    negative = np.stack([block, rng.integers(0, slots, block.size), other,
                         rng.integers(0, slots, block.size)], axis=1)
    return positive, negative


def scores(model: MLAModel, rows: torch.Tensor, index: np.ndarray,
           positions: list[int]) -> dict[str, np.ndarray]:
    """Cosine similarity of each component over the pairs ``index`` (every token offset) of
    one layer's rows [blocks, slots, tokens, L+R]."""
    rank = model.config.kv_lora_rank
    first, second = rows[index[:, 0], index[:, 1]], rows[index[:, 2], index[:, 3]]
    tokens = rows.shape[2]
    first, second = first.reshape(-1, rows.shape[-1]), second.reshape(-1, rows.shape[-1])
    delta = np.asarray(positions)[index[:, 3]] - np.asarray(positions)[index[:, 1]]
    rotated = model.rotary.rotate(first[:, rank:], torch.from_numpy(np.repeat(delta, tokens)))
    return {"c_KV": cosine(first[:, :rank], second[:, :rank]),
            "k_r": cosine(first[:, rank:], second[:, rank:]),
            "row": cosine(first, second),
            "k_r_rotated": cosine(rotated, second[:, rank:])}


def roc_study(model: MLAModel, text: AgentText, settings: RocSettings | None = None, *,
              model_name: str = "") -> RocResult:
    """Capture every block's rows at every slot and compute each component's AUC per layer."""
    settings = settings or RocSettings()
    if settings.blocks < 2:
        raise ValueError("the ROC study needs at least 2 blocks (negatives pair two)")
    started = time.perf_counter()
    rng = np.random.default_rng(settings.seed)
    blocks = text.pieces(settings.blocks, settings.block_tokens, rng)
    rows = capture(model, text, settings, blocks)
    positive, negative = pairs(settings.blocks, len(settings.slots), rng)
    result = RocResult(model_name, settings, positive.shape[0] * settings.block_tokens,
                       negative.shape[0] * settings.block_tokens,
                       {name: [] for name in COMPONENTS})
    for layer_rows in rows:
        pos = scores(model, layer_rows, positive, settings.positions)
        neg = scores(model, layer_rows, negative, settings.positions)
        for name in COMPONENTS:
            result.auc[name].append(auc(pos[name], neg[name]))
    result.seconds = time.perf_counter() - started
    return result


COLOURS = {"c_KV": "#4C72B0", "k_r": "#C44E52", "row": "#8C8C8C", "k_r_rotated": "#55A868"}


def plot_roc(result: RocResult, path: Path) -> None:
    """Left: mean AUC per component with the paper's values; right: AUC per layer."""
    fig, (left, right) = figure(2)
    means = result.auc_mean
    names = list(COMPONENTS)
    left.bar(names, [means[n] for n in names], color=[COLOURS[n] for n in names])
    for i, name in enumerate(names):
        left.text(i, means[name] + 0.01, f"{means[name]:.3f}", ha="center", fontsize=8)
        if name in PAPER_AUC:
            left.plot([i - 0.4, i + 0.4], [PAPER_AUC[name]] * 2, "k--", lw=1,
                      label="paper" if i == 0 else None)
    left.axhline(0.5, color="k", lw=0.8)
    left.set_ylim(0, 1)
    left.set_ylabel("position-invariance AUC (mean over layers)")
    left.legend(fontsize=8, loc="lower right", framealpha=1)
    layers = np.arange(len(result.auc["c_KV"]))
    for name in names:
        right.plot(layers, result.auc[name], "o-", color=COLOURS[name], label=name)
    right.axhline(0.5, color="k", lw=0.8)
    right.set_ylim(0, 1)
    right.set_xticks(layers)
    right.set_xlabel("layer")
    right.set_ylabel("AUC")
    right.legend(fontsize=8)
    s = result.settings
    fig.suptitle(f"Position invariance ({result.model}): {s.blocks} blocks × {len(s.slots)} "
                 f"slots, {s.block_tokens} tokens each; AUC > 0.5: content outweighs position",
                 fontsize=9)
    save_png(fig, path)


def render_roc(result: RocResult) -> str:
    """The AUC table: one row per component, mean over layers, per layer and the paper's."""
    layers = len(result.auc["c_KV"])
    rows = [[name, f"{result.auc_mean[name]:.3f}", *(f"{v:.3f}" for v in result.auc[name]),
             f"{PAPER_AUC[name]:.2f}" if name in PAPER_AUC else "—"] for name in COMPONENTS]
    s = result.settings
    return table(f"Position-invariance AUC ({s.blocks} blocks of {s.block_tokens} tokens at "
                 f"positions {', '.join(map(str, s.positions))}; {result.positive_pairs:,} "
                 "positive and as many negative pairs per layer; > 0.5: content outweighs "
                 "position)", ["component", "mean", *(f"L{i}" for i in range(layers)), "paper"],
                 rows)
