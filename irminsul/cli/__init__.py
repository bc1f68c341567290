"""The ``irminsul`` command line: analyze request logs, build workloads, run the demo, and run a
model (the embedded default unless ``--model DIR``) over workloads or behind an HTTP API."""

from __future__ import annotations

import argparse
import logging
import sys

from .. import __version__
from ..traffic.logs import LogError
from . import analysis, bench, measure, serve
from .common import global_options


def build_parser() -> argparse.ArgumentParser:
    """The ``irminsul`` argument parser: global options and one subparser per command."""
    parser = argparse.ArgumentParser(prog="irminsul", description=__doc__)
    parser.add_argument("--version", action="version", version=f"irminsul {__version__}",
                        help="print the version and exit")
    global_options(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                help="what to do; irminsul COMMAND --help for its options")
    # in the order --help lists them
    analysis.add_commands(sub)  # analyze, workload, demo
    measure.add_commands(sub)  # consistency, gate, study
    bench.add_commands(sub)  # bench, bench serve
    serve.add_commands(sub)  # router, serve
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (2 for bad input, as argparse does)."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        status = args.func(args)  # None, or a command's own status (gate: 1 when refused)
    except (LogError, FileNotFoundError, ValueError) as err:
        print(f"irminsul: error: {err}", file=sys.stderr)
        return 2
    return status or 0
