"""The command line: `python -m acceldemo info | generate | warmup | cache | compare | plan | bench | serve`, headless
(serve: the page and the API), on the same engine as the UI."""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from ..config import Settings, store_url
from ..errors import AcceldemoError
from ..hardware import prepare_process
from . import bench, cache, compare, generate, info, plan, serve, warmup
from .common import PROG, CommandParser, HelpFormatter

# In the order the help lists them.
COMMANDS = (info, generate, warmup, cache, compare, plan, bench, serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=HelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=CommandParser,
                                     title="commands", help="`COMMAND --help` describes each")
    for command in COMMANDS:
        command.add_parser(commands)
    return parser


def _run(args: argparse.Namespace) -> int:
    if args.command == "serve":
        return serve.serve(args)
    try:
        settings = Settings.from_env()
        if getattr(args, "artifacts", None):
            settings = dataclasses.replace(settings, artifacts=store_url(args.artifacts, "--artifacts"))
        if getattr(args, "download", False):
            settings = dataclasses.replace(settings, download=True)
        prepare_process(settings)
        if args.command == "bench":
            return bench.cmd_bench(args, settings)
        if args.command == "cache":
            return cache.cmd_cache(args, settings)
        if args.command == "plan":
            return plan.cmd_plan(args, settings)
        from ..builder import build_engine

        engine = build_engine(settings)
        try:
            return {"info": info.cmd_info, "generate": generate.cmd_generate, "warmup": warmup.cmd_warmup,
                    "compare": compare.cmd_compare}[args.command](args, engine)
        finally:
            engine.close()
    except (AcceldemoError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        status = _run(args)
        sys.stdout.flush()  # here, where a closed pipe can still be caught, rather than at the interpreter's exit
        return status
    except BrokenPipeError:
        # The reader went away (`plan | head -1`): no traceback, and nothing more to flush into the closed pipe.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 1
