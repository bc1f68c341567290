"""Where live PIC's KL comes from, request by request: the session served in order (as a server
serves it) against each request served after only the one before it.

For each of a workload's first requests, served in order by one persistent live engine: its
KL(full ‖ served) per teacher-forced step against full recomputation, argmax match, and where its
prompt came from — exact prefix, derived prefix (the radix tree's match over an earlier turn's
reused rows), PIC hits, computed. Then the same request served by a fresh live engine that first
served only the request before it, fully computed: one level of reuse, the history exact. The
difference between the two is what earlier turns' reuse adds through the prefix; the largest
single step says whether one token carries the mean (a copy from a reused document). And the
session once more on a live engine that heals after every request (*healed*: what a server does
in the idle time between an agent's turns with ``CacheConfig.heal`` on): the history exact again, each
turn's own reuse left.

    python benchmarks/cpu/kl_anatomy.py [--workload rerank] [--requests 12] [--tokens 16]
                                        [--model DIR] [--out F]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
from common import run_metadata  # noqa: E402

from irminsul.analysis.consistency import (  # noqa: E402
    full_continuation,
    kl_per_step,
    render_prompts,
)
from irminsul.config import CacheConfig, EngineConfig  # noqa: E402
from irminsul.engine import Engine  # noqa: E402
from irminsul.loadgen.workloads import load_workload  # noqa: E402
from irminsul.model import default_model_dir, load_model  # noqa: E402
from irminsul.traffic.render import ChatRenderer  # noqa: E402
from irminsul.traffic.workloads import PATTERNS  # noqa: E402


def served(engine: Engine, prompt: Any, continuation: list[int],
           full_logits: torch.Tensor) -> dict[str, Any]:
    """One request on ``engine``: KL per teacher-forced step, argmax match, where it came from."""
    seq, first = engine.prefill(prompt.tokens, prompt.resets)
    try:
        logits = torch.cat([first[None], engine.extend(seq, continuation[:-1])])
        stats = seq.stats
        kl = kl_per_step(full_logits, logits)
        return {"kl": float(kl.mean()), "kl_steps": [float(x) for x in kl],
                "argmax": float((logits.argmax(-1).cpu() == torch.tensor(continuation))
                                .double().mean()),
                "prompt_tokens": stats.prompt_tokens, "prefix_tokens": stats.prefix_tokens,
                "derived_prefix_tokens": stats.derived_prefix_tokens,
                "pic_tokens": stats.pic_tokens, "prefilled_tokens": stats.prefilled_tokens,
                "first_reused": seq.exact}
    finally:
        engine.finish(seq)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="rerank", choices=PATTERNS)
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=16, help="continuation tokens")
    parser.add_argument("--model", type=Path, default=None,
                        help="checkpoint directory (default: the embedded model)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (torch)")
    parser.add_argument("--out", help="results JSON")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    directory = args.model or default_model_dir()
    model = load_model(directory, dtype=torch.float32, device="cpu")
    renderer = ChatRenderer.from_dir(directory)
    started = time.perf_counter()
    prompts = [p for _, p in render_prompts(renderer, load_workload(args.workload, renderer)
                                            [:args.requests], model.config.vocab_size)]
    references = [full_continuation(model, p.tokens, args.tokens) for p in prompts]
    slots = sum(p.size + 2 * args.tokens for p in prompts)
    session = Engine(model, EngineConfig(slots=slots, mode="live"))
    healing = Engine(model, EngineConfig(slots=slots, mode="live", cache=CacheConfig(heal=True)))
    rows = []
    for i, (prompt, (continuation, logits)) in enumerate(zip(prompts, references)):
        row = {"request": i, "session": served(session, prompt, continuation, logits),
               "healed": served(healing, prompt, continuation, logits)}
        healing.heal()
        if i:
            alone = Engine(model, EngineConfig(slots=slots, mode="live"))
            before, (cont_before, _) = prompts[i - 1], references[i - 1]
            seq, _ = alone.prefill(before.tokens, before.resets)
            alone.extend(seq, cont_before[:-1])
            alone.finish(seq)
            row["after_one"] = served(alone, prompt, continuation, logits)
        rows.append(row)
        s = row["session"]
        one = row.get("after_one")
        print(f"{i:>2}: KL {s['kl']:.2e} (largest step {max(s['kl_steps']):.2e}) argmax "
              f"{s['argmax']:.3f}; exact prefix {s['prefix_tokens']}, derived "
              f"{s['derived_prefix_tokens']}, PIC {s['pic_tokens']}, computed "
              f"{s['prefilled_tokens']}" + (f"; after one: KL {one['kl']:.2e}" if one else "")
              + f"; healed: KL {row['healed']['kl']:.2e}", flush=True)
    hits = [r for r in rows if r["session"]["pic_tokens"] or r["session"]["derived_prefix_tokens"]]
    means = {"session_kl": float(np.mean([r["session"]["kl"] for r in hits])),
             "after_one_kl": float(np.mean([r["after_one"]["kl"] for r in hits
                                            if "after_one" in r])),
             "healed_kl": float(np.mean([r["healed"]["kl"] for r in hits])),
             "healed_argmax": float(np.mean([r["healed"]["argmax"] for r in hits])),
             "session_argmax": float(np.mean([r["session"]["argmax"] for r in hits])),
             "largest_request_share": float(max(r["session"]["kl"] for r in hits)
                                            / sum(r["session"]["kl"] for r in hits)),
             "requests_with_reuse": len(hits)}
    print(f"mean KL over {len(hits)} requests with reuse: session {means['session_kl']:.3e}, "
          f"after one {means['after_one_kl']:.3e}, healed {means['healed_kl']:.3e}; argmax "
          f"session {means['session_argmax']:.3f}, healed {means['healed_argmax']:.3f}; the "
          "largest request holds "
          f"{means['largest_request_share']:.0%} of the session's sum")
    report = {"workload": args.workload, "requests": args.requests, "tokens": args.tokens,
              "model": directory.name, "rows": rows, "means": means,
              "seconds": round(time.perf_counter() - started, 1), "meta": run_metadata("cpu")}
    argv = sys.argv[1:]
    if "--out" in argv:
        argv[argv.index("--out") + 1] = "F.json"
    report["meta"]["command"] = " ".join(["python benchmarks/cpu/kl_anatomy.py", *argv])
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
