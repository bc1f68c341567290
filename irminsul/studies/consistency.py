"""Output consistency over the five partition-shift workloads (paper Table 2, Appendix H).

For each workload pattern (agent_meta, sysvar, compact, rerank, tool_variants) a log is built
from the shipped tau-bench sample with real agent text (:func:`~irminsul.traffic.workloads.
build_workload`, as ``irminsul workload`` builds it) and run through
:func:`irminsul.analysis.consistency.consistency` — full recomputation against a live PIC engine
(k_r rotated by δ) and a naive-reuse engine (k_r unrotated): per-step KL(p_full ‖ p_x),
argmax-match and first divergence of a teacher-forced greedy continuation, over the requests
where either engine served prompt tokens from the registry. Nothing of that machinery is
repeated here; this module picks the workloads, collects the rows and draws them.

The paper's datasets (QA, GovReport, NIAH) are replaced by the five agent workloads, and its
n = 30–100 requests per cell by ``requests`` per workload (default 3, with 8 continuation
tokens, to stay near a minute on two CPU cores with the embedded model; the first calls of a
session are short, and compact changes nothing before a session's third tool result, so it has
no hits at this size: ``--requests 12`` gives every pattern hits).

JSON (``consistency.json``): ``study``, ``model``, ``settings`` {requests, tokens,
header_tokens, seed, patterns, heal}, ``workloads`` {pattern: the consistency report without its
per-request rows: ``kl_pic``, ``kl_naive``, ``argmax_pic``, ``argmax_naive``,
``first_divergence_pic``, ``first_divergence_naive`` (requests with hits; ``_all`` suffix: every
request), ``requests``, ``requests_with_hits``, ``pic_token_fraction``, ``served``, ...},
``seconds``.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..analysis.consistency import consistency
from ..analysis.report import table
from ..model import MLAModel
from ..traffic.logs import Request, read_requests, sample_logs
from ..traffic.render import ChatRenderer
from ..traffic.workloads import PATTERNS, TextPool, build_workload
from .plot import figure, save_png


@dataclass
class ConsistencySettings:
    requests: int = 3
    tokens: int = 8
    header_tokens: int = 250
    seed: int = 0
    patterns: tuple[str, ...] = PATTERNS
    heal: bool = False  # engines heal between requests (CacheConfig.heal, serve --heal)


@dataclass
class ConsistencyResult:
    model: str
    settings: ConsistencySettings
    workloads: dict[str, dict] = field(default_factory=dict)  # pattern -> consistency report
    seconds: float = 0.0

    def to_json(self) -> dict:
        return {"study": "consistency", "model": self.model, "settings": asdict(self.settings),
                "workloads": {p: {k: v for k, v in r.items() if k != "per_request"}
                              for p, r in self.workloads.items()},
                "seconds": round(self.seconds, 1)}


def workload_requests(pattern: str, pool: TextPool,
                      settings: ConsistencySettings) -> list[Request]:
    """``pattern``'s log built from the shipped tau-bench sample's requests and ``pool``'s text,
    as ``irminsul workload`` would write it."""
    bodies = list(read_requests(sample_logs()[0], strict=True))
    built = build_workload(pattern, bodies, pool, requests=settings.requests,
                           header_tokens=settings.header_tokens, seed=settings.seed)
    return [Request(line["session"], line["call"], line["messages"], line["tools"],
                    f"{pattern}:{i + 1}") for i, line in enumerate(built)]


def sample_pool(renderer: ChatRenderer) -> TextPool:
    """The user and tool messages of the shipped samples: the text workloads add."""
    texts = [m["content"] for src in sample_logs() for r in read_requests(src) for m in r.messages
             if isinstance(m.get("content"), str) and m["role"] in ("user", "tool")]
    return TextPool(texts, renderer)


def consistency_study(model: MLAModel, renderer: ChatRenderer,
                      settings: ConsistencySettings | None = None, *, model_name: str = "",
                      progress: bool = False) -> ConsistencyResult:
    """The consistency report of every workload pattern."""
    settings = settings or ConsistencySettings()
    started = time.perf_counter()
    result = ConsistencyResult(model_name, settings)
    pool = sample_pool(renderer)
    for pattern in settings.patterns:
        requests = workload_requests(pattern, pool, settings)
        result.workloads[pattern] = consistency(model, renderer, requests,
                                                tokens=settings.tokens, heal=settings.heal,
                                                progress=progress)
    result.seconds = time.perf_counter() - started
    return result


def plot_consistency(result: ConsistencyResult, path: Path) -> None:
    """Per workload, PIC against naive reuse: mean KL from full recomputation (log scale) and
    argmax-match, over the requests with PIC hits."""
    fig, (kl, match) = figure(2)
    patterns = list(result.workloads)
    x = np.arange(len(patterns))
    for k, (path_name, colour) in enumerate((("pic", "#4C72B0"), ("naive", "#C44E52"))):
        kls = [result.workloads[p][f"kl_{path_name}"] for p in patterns]
        argmax = [result.workloads[p][f"argmax_{path_name}"] for p in patterns]
        # A workload without hits has no figure (None): drawn as a missing bar.
        kl.bar(x + (k - 0.5) * 0.4, [np.nan if v is None else max(v, 1e-12) for v in kls], 0.4,
               color=colour, label=path_name)
        match.bar(x + (k - 0.5) * 0.4, [np.nan if v is None else v for v in argmax], 0.4,
                  color=colour, label=path_name)
    kl.set_yscale("log")
    kl.set_ylabel("KL(p_full ‖ p_x) per step (nats)")
    match.set_ylabel("argmax-match vs full recomputation")
    match.set_ylim(0, 1.05)
    for ax in (kl, match):
        ax.set_xticks(x, patterns, fontsize=7)
        ax.legend(fontsize=8)
    s = result.settings
    fig.suptitle(f"Output consistency ({result.model}): {s.requests} requests per workload, "
                 f"{s.tokens} tokens each, requests with PIC hits", fontsize=9)
    save_png(fig, path)


def render_consistency_study(result: ConsistencyResult) -> str:
    """One row per workload: PIC and naive KL and argmax-match over the requests with hits."""
    def cell(value: float | None, fmt: str) -> str:
        return "—" if value is None else format(value, fmt)

    rows = [[pattern, f"{r['requests_with_hits']}/{r['requests']}",
             f"{100 * r['pic_token_fraction']:.1f}%", cell(r["kl_pic"], ".3g"),
             cell(r["kl_naive"], ".3g"), cell(r["argmax_pic"], ".3f"),
             cell(r["argmax_naive"], ".3f"), cell(r["first_divergence_pic"], ".2f"),
             cell(r["first_divergence_naive"], ".2f")]
            for pattern, r in result.workloads.items()]
    s = result.settings
    return table(f"Output consistency vs full recomputation per workload ({s.requests} requests, "
                 f"{s.tokens} tokens each; figures over the requests with PIC hits, — where none)",
                 ["workload", "hit requests", "PIC tokens", "KL pic", "KL naive", "argmax pic",
                  "argmax naive", "first div. pic", "first div. naive"], rows)
