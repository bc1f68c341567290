"""Time `irminsul analyze` on a whole request log (default: the shared mini-swe-agent log).

Target: the full mini-swe-agent log, 20,163 requests / ~3e8 prompt tokens, in <= 90 s on the
2-core CI machine. Prints requests, prompt tokens, wall time, tokens/s and the peak RSS of the
analysing process and of the largest render worker (analysis/prompts.py).
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

from irminsul.analysis.analyze import analyze_log
from irminsul.traffic.render import ChatRenderer

# The shared traces lie beside the repository, whatever directory the script is run from.
DEFAULT_LOG = str(Path(__file__).resolve().parents[3] / "shared" / "traces"
                  / "mini-swe-agent-gemini3pro.requests.jsonl.xz")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", nargs="?", default=DEFAULT_LOG)
    parser.add_argument("--json", help="also write the analyze report here")
    parser.add_argument("--workers", type=int, help="render processes (default: one per core)")
    args = parser.parse_args()
    started = time.perf_counter()
    report = analyze_log(args.log, ChatRenderer.default(), workers=args.workers)
    seconds = time.perf_counter() - started
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    worker_gb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    print(f"log            {args.log}")
    print(f"requests       {report['requests']:,}")
    print(f"prompt tokens  {report['prompt_tokens']:,}")
    print(f"wall time      {seconds:.1f} s  (target <= 90 s on 2 cores)")
    print(f"throughput     {report['prompt_tokens'] / seconds / 1e6:.2f} M prompt tokens/s")
    print(f"peak RSS       {peak_gb:.2f} GB (analysis), {worker_gb:.2f} GB (largest render worker)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
