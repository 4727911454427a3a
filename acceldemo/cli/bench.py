"""`python -m acceldemo bench`: the subcommand; its options and the measuring belong to acceldemo.bench."""
from __future__ import annotations

from ..bench import add_arguments, cmd_bench

HELP = "measure manager, pool, restart, compile and serving costs as ratios"
# Help for the bench options acceldemo.bench leaves without one.
_MISSING_HELP = {"--hardware": "the hardware to measure on"}


def add_parser(commands) -> None:
    bench = commands.add_parser("bench", help=HELP, description=HELP)
    add_arguments(bench)
    for action in bench._actions:
        if not action.help:
            action.help = next((text for option, text in _MISSING_HELP.items() if option in action.option_strings),
                               f"{action.dest.replace('_', ' ')} of the bench")


__all__ = ["HELP", "add_parser", "cmd_bench"]
