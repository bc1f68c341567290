"""``irminsul bench serve``: a serving load benchmark that replays agent sessions over HTTP.

    workloads.py  the logs it replays (named workloads built from the shipped samples, or a log)
    sessions.py   a log's sessions, each call's reply length read from the log
    client.py     one streamed chat call, timed (TTFT, TPOT, end to end) with its usage
    runner.py     sessions side by side: at a fixed concurrency or arriving at a Poisson rate
    server.py     ``irminsul serve`` as a subprocess on a free loopback port
    report.py     percentiles, throughput, cache shares, live against off; the tables
    bench.py      all of it per PIC mode
"""

from .bench import Load, bench_serve
from .report import render
from .server import ServerError
from .sessions import build_sessions
from .workloads import NAMES, load_workload

__all__ = ["NAMES", "Load", "ServerError", "bench_serve", "build_sessions", "load_workload",
           "render"]
