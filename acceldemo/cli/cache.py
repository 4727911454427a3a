"""`python -m acceldemo cache`: the precompiled packages here and in the shared artifact store; verify, prune."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

from ..config import Settings
from .common import artifacts_arg

HELP = ("list the precompiled packages here and in the shared artifact store, with who signed each; --verify checks "
        "the store's checksums and signatures, --prune removes what is unusable")


def add_parser(commands) -> None:
    cache = commands.add_parser("cache", help=HELP, description=HELP)
    cache.add_argument("--verify", action="store_true",
                       help="download every artifact of the shared store and check it against its manifest, and "
                            "the manifest's signature against ACCELDEMO_ARTIFACTS_TRUST")
    cache.add_argument("--prune", action="store_true",
                       help="delete local packages built by another torch/CPU/GPU toolchain and leftovers of killed "
                            "builds; in the shared store, manifests whose object is missing, objects no manifest "
                            "names (older than --grace) and, with --verify, artifacts that fail their checksum or "
                            "signature")
    cache.add_argument("--grace", type=float, default=3600.0, metavar="SECONDS",
                       help="age under which an object without a manifest is left alone: an upload may be in flight "
                            "(default 3600)")
    cache.add_argument("--json", action="store_true", help="one JSON object instead of text")
    artifacts_arg(cache)


def cmd_cache(args, settings: Settings) -> int:
    from ..executors.artifacts import ArtifactStore
    from ..hardware import HardwareRegistry

    store = ArtifactStore.of(settings)
    removed = store.prune(HardwareRegistry(settings).toolchain_here) if args.prune else []
    packages = store.packages()
    shared = _shared_store(store, args) if store.remote is not None else None
    if args.json:
        print(json.dumps({"folder": str(store.root), "packages": packages, "removed": removed, "store": shared},
                         indent=2))
        return 0 if shared is None or not shared.get("error") else 1
    print(f"{len(packages)} precompiled package(s) in {store.root}")
    for entry in packages:
        print(f"  {entry.get('model', '?'):<17} {entry.get('hardware', '?'):<5} {entry.get('shape') or '?':<9} "
              f"{entry['megabytes']:>7.2f} MB  {entry.get('age_days', 0):>5.1f} d  {entry.get('toolchain', 'no JSON')}")
    for path in removed:
        print(f"  removed {path}")
    if shared is None:
        return 0
    if shared.get("error"):
        print(f"shared artifact store {shared['url']}: cannot be read ({shared['error']})")
        return 1
    print(f"{len(shared['artifacts'])} artifact(s) in the shared store {shared['url']}")
    for entry in shared["artifacts"]:
        about = entry.get("about") or {}
        state = entry.get("problem") or ("verified" if args.verify else "")
        signature = (entry.get("signature_state") or {}).get("text", "")
        print(f"  {about.get('model', entry['name']):<17} {about.get('hardware', ''):<5} "
              f"{about.get('shape', ''):<9} {(entry.get('bytes') or 0) / 2**20:>7.2f} MB  "
              f"{about.get('toolchain', '')}  {state}  {signature}".rstrip())
    for path in shared["removed"]:
        print(f"  removed {path}")
    return 0


def _shared_store(store, args) -> dict:
    """The shared store's artifacts (verified and pruned as asked), or the error that kept it from being read."""
    remote = store.remote
    try:
        listed = remote.entries()
        removed = []
        with tempfile.TemporaryDirectory(prefix="acceldemo-verify-") as scratch:
            for entry in listed:
                entry["problem"] = None
                if entry.get("orphan"):
                    entry["problem"] = "an object without a manifest (an upload cut short, in flight, or the loser " \
                                       "of two publications at once)"
                elif entry.get("broken") or not entry["present"] or args.verify:
                    entry["problem"] = remote.verify(entry, Path(scratch))
                young = entry.get("orphan") and (entry.get("age_s") or 0) < args.grace
                if args.prune and entry.get("problem") and not young:
                    removed += remote.remove(entry)
    except Exception as error:  # the store cannot be reached or read: said, not a stack trace
        return {"url": remote.report()["url"], "error": f"{type(error).__name__}: {error}"}
    return {"url": remote.report()["url"], "artifacts": listed, "removed": removed}
