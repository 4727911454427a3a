"""`python -m acceldemo bench`: manager, pool, restart, compile and serving costs measured side by side, as ratios."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `bench` subcommand's options (the CLI owns the subcommand, this package its options)."""
    from .plans import OPTIONAL_SECTIONS, SECTIONS

    level = parser.add_mutually_exclusive_group()
    level.add_argument("--quick", action="store_true",
                       help="fewer runs, aot_eager in-process (about 2 minutes on 2 shared CPU cores)")
    level.add_argument("--smoke", action="store_true", help="every section once, fewest runs: checks, not figures")
    from ..hardware import hardware_names

    parser.add_argument("--hardware", default="cpu", choices=hardware_names())
    parser.add_argument("--out", type=Path, default=Path("bench-results"),
                        help="folder for bench.json, bench.md and bench.png (default bench-results/)")
    parser.add_argument("--sections", default=",".join(SECTIONS), metavar="NAME,...",
                        help=f"sections to run (default: {','.join(SECTIONS)}; also by name: "
                             f"{','.join(OPTIONAL_SECTIONS)})")


def cmd_bench(args: argparse.Namespace, settings) -> int:
    """Run the asked-for sections, write the report files, print the table; 1 if a section failed."""
    from .plans import OPTIONAL_SECTIONS, PLANS, SECTIONS, BenchOptions
    from .report import markdown, write_report
    from .runner import run_bench

    sections = tuple(s.strip() for s in args.sections.split(",") if s.strip())
    unknown = sorted(set(sections) - set(SECTIONS) - set(OPTIONAL_SECTIONS))
    if unknown:
        print(f"error: sections={','.join(unknown)} is not accepted: known values are "
              f"{', '.join(SECTIONS + OPTIONAL_SECTIONS)}", file=sys.stderr)
        return 2
    level = "quick" if args.quick else "smoke" if args.smoke else "full"
    command = "python -m acceldemo bench" + ("" if level == "full" else f" --{level}") + \
        ("" if args.hardware == "cpu" else f" --hardware {args.hardware}") + \
        ("" if set(sections) == set(SECTIONS) else f" --sections {','.join(sections)}")
    report = run_bench(BenchOptions(PLANS[level], args.hardware, sections, command), settings)
    paths = write_report(report, args.out)
    print(markdown(report))
    print("written: " + ", ".join(str(p) for p in paths.values()))
    return 1 if report.failures else 0
