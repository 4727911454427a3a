"""`python -m acceldemo warmup`: compile shapes ahead of requests, report their cost, optionally publish them."""
from __future__ import annotations

import json

from ..errors import InvalidRequest
from .common import TerminalProgress, artifacts_arg, download_arg, request_args, request_params

HELP = "compile shapes ahead of requests and report their cost"


def add_parser(commands) -> None:
    warmup = commands.add_parser("warmup", help=HELP, description=HELP)
    request_args(warmup)
    warmup.add_argument("--batch", type=int, action="append", dest="batches", metavar="N",
                        help="also compile calls drawing N requests together (a compiled mode's bucket, e.g. --batch 2 "
                             "--batch 4); repeat for several (default: 1)")
    warmup.add_argument("--json", action="store_true", help="one JSON line per shape and batch on stdout")
    warmup.add_argument("--push", action="store_true",
                        help="publish the compiled packages to the shared artifact store (--artifacts), also those "
                             "that were already in the local cache, so serving hosts never compile them (signed with "
                             "ACCELDEMO_ARTIFACTS_SIGNING_KEY when set)")
    artifacts_arg(warmup)
    download_arg(warmup)


def cmd_warmup(args, engine) -> int:
    if args.push and engine.artifacts.remote is None:
        raise InvalidRequest("push", True, "a shared artifact store to publish to: --artifacts URL or "
                                           "ACCELDEMO_ARTIFACTS")
    records = engine.warm_up(request_params(args)[0], args.sizes, TerminalProgress(), args.batches or (1,))
    for record in records:
        facts = {"shape": str(record.shape), "batch": record.batch, "state": record.state, "graphs": record.graphs,
                 "compile_seconds": round(record.compile_seconds, 3), "first_call_seconds": record.first_call_seconds}
        batch = f" ×{record.batch}" if record.batch > 1 else ""
        print(json.dumps(facts) if args.json else
              f"{record.shape}{batch}: {record.state}, {record.graphs} graphs, compile {record.compile_seconds:.2f} s")
    if args.push:
        # Packages built just now are published already; this adds those the local cache held before.
        asked = engine.check(request_params(args)[0])
        pushed = engine.artifacts.push(lambda entry: (entry.get("model"), entry.get("hardware")) ==
                                       (asked.model, asked.hardware))
        store = engine.artifacts.store_report()
        facts = {"pushed": pushed, "published": store["published"], "store": store["url"],
                 "store_error": store["error"]}
        print(json.dumps(facts) if args.json else
              f"shared artifact store {store['url']}: {store['published']} package(s) published"
              + (f" (store error: {store['error']})" if store["error"] else ""))
        if store["error"]:
            return 1
    return 0
