"""The command line: `python -m acceldemo info | generate | warmup | bench`, headless, on the same engine as the UI."""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from . import config
from .bench import add_arguments as add_bench_arguments
from .bench import cmd_bench
from .engine import PLACEMENTS
from .errors import AcceldemoError, InvalidRequest
from .hardware import all_modes, hardware_names
from .records import GenerateRequest, Progress, Shape


def _shape(text: str) -> Shape:
    shape = Shape.parse(text)
    if shape is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: write WIDTHxHEIGHT, e.g. 1024x1024")
    return shape


class TerminalProgress:
    """Progress events as terminal lines; denoise steps overwrite one line on a terminal."""

    def __init__(self, stream=sys.stderr):
        self.stream = stream
        self.started = time.perf_counter()
        self.tty = stream.isatty()

    def __call__(self, event: Progress) -> None:
        elapsed = time.perf_counter() - self.started
        text = f"[{elapsed:7.2f}s] {event.phase:<8} {event.message}"
        if event.phase == "denoise" and self.tty:
            end = "\n" if event.step == event.total else "\r"
            self.stream.write(text + end)
        elif event.phase != "denoise" or event.step == event.total:
            self.stream.write(text + "\n")
        self.stream.flush()


def _request_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="catalog model (default: the embedded tiny model); see `info`")
    parser.add_argument("--hardware", choices=hardware_names(),
                        help="default: the first accelerator found, else cpu")
    parser.add_argument("--device", help="a device (cuda:1) or group (neuron:0-1) to run on; default: any free one")
    parser.add_argument("--mode", default="eager", choices=all_modes())
    parser.add_argument("--placement", choices=PLACEMENTS,
                        help="default: proposed from the model size and device memory")
    parser.add_argument("--tp", type=int, dest="tp_size", help="tensor-parallel world size with --placement tp")
    parser.add_argument("--size", type=_shape, action="append", dest="sizes", metavar="WxH",
                        help="image size; repeat for several (default: the model's)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m acceldemo", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser("info", help="hardware found and absent (with reasons), models, modes")
    info.add_argument("--json", action="store_true", help="one JSON object instead of text")

    generate = commands.add_parser("generate", help="generate images, each size in order, --repeat times each")
    generate.add_argument("--prompt", required=True)
    _request_args(generate)
    generate.add_argument("--steps", type=int)
    generate.add_argument("--guidance", type=float)
    generate.add_argument("--seed", type=int, default=0)
    generate.add_argument("--repeat", type=int, default=1, help="runs per size (default 1)")
    generate.add_argument("--out", type=Path, default=Path("outputs"), help="folder for the PNGs (default outputs/)")
    generate.add_argument("--json", action="store_true", help="one JSON line per image on stdout")

    warmup = commands.add_parser("warmup", help="compile shapes ahead of requests and report their cost")
    _request_args(warmup)
    warmup.add_argument("--json", action="store_true", help="one JSON line per shape on stdout")

    cache = commands.add_parser("cache", help="list the precompiled packages; --prune removes the unusable ones")
    cache.add_argument("--prune", action="store_true",
                       help="delete packages built by another torch/CPU/GPU toolchain, and leftovers of killed builds")
    cache.add_argument("--json", action="store_true", help="one JSON object instead of text")

    bench = commands.add_parser("bench", help="measure manager, pool, restart, compile and serving costs as ratios")
    add_bench_arguments(bench)
    return parser


def cmd_info(args) -> int:
    from .engine import mode_options, propose_placement
    from .executors.artifacts import ArtifactStore
    from .hardware import HARDWARE, detect_all
    from .models.catalog import CATALOG

    settings = config.settings()
    found = detect_all()
    hardware = {name: {"available": a.available, "reason": a.reason,
                       "devices": [{"device": str(d), "memory_gb": round(d.memory_bytes / 1e9, 1), "detail": d.detail}
                                   for d in HARDWARE[name].devices()],
                       "modes": list(HARDWARE[name].modes), "compile_backend": HARDWARE[name].compile_backend,
                       "dist_backend": HARDWARE[name].dist_backend}
                for name, a in found.items()}
    models = {}
    for spec in CATALOG.values():
        models[spec.name] = {
            "title": spec.title, "pipeline": spec.pipeline_class, "repo": spec.repo, "steps": spec.steps,
            "guidance": spec.guidance, "default_size": str(spec.default_shape),
            "presets": [str(s) for s in spec.presets], "granularity": spec.granularity,
            "placement": {n: propose_placement(spec, a, HARDWARE[n].tensor_parallel_sizes()).__dict__
                          for n, a in found.items() if a.available},
            "modes": {n: {o.name: (o.ok, o.reason) for o in mode_options(spec, HARDWARE[n], None)}
                      for n, a in found.items() if a.available}}
    packages = ArtifactStore.of(settings).report(settings.precompile)
    if args.json:
        print(json.dumps({"hardware": hardware, "models": models, "default_model": settings.default_model,
                          "precompiled": packages}, indent=2))
        return 0
    print("Hardware")
    for name, h in hardware.items():
        mark = "found " if h["available"] else "absent"
        print(f"  {name:<7} {mark}  {h['reason']}" + (f"  modes: {', '.join(h['modes'])}" if h["available"] else ""))
        for device in h["devices"]:
            print(f"    {device['device']:<9} {device['memory_gb']:>7.1f} GB  {device['detail']}".rstrip())
    print("Models" + f" (default {settings.default_model})")
    for name, m in models.items():
        print(f"  {name:<17} {m['pipeline']:<25} {m['steps']:>2} steps, guidance {m['guidance']}, "
              f"default {m['default_size']}, presets {' '.join(m['presets'])}")
        for hw, modes in m["modes"].items():
            place = m["placement"][hw]
            refused = [f"{mode} ({why})" for mode, (ok, why) in modes.items() if not ok]
            print(f"      on {hw}: placement {place['name']} ({place['reason']})"
                  + (f"; not: {'; '.join(refused)}" if refused else ""))
    print(f"Precompiled packages ({packages['setting']}): {packages['packages']} in {packages['folder']} "
          f"({packages['megabytes']} MB)")
    return 0


def _requests(args, prompt: str = "warm-up", **extra) -> list[GenerateRequest]:
    sizes = args.sizes or [None]
    return [GenerateRequest(prompt=prompt, model=args.model, hardware=args.hardware, mode=args.mode,
                            placement=args.placement, tp_size=args.tp_size, device=args.device,
                            width=s.width if s else None, height=s.height if s else None, **extra) for s in sizes]


def check_output_folder(folder: Path) -> Path:
    """The folder for the images, created now and proved writable, so no image is made only to be lost."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".acceldemo-write-check-"):
            pass
    except OSError as error:
        raise InvalidRequest("out", str(folder), f"a folder this user can create and write to "
                                                 f"({error.strerror or type(error).__name__})") from None
    return folder


def cmd_generate(args, manager) -> int:
    if args.repeat < 1:
        raise InvalidRequest("repeat", args.repeat, "a whole number of at least 1")
    requests = [manager.check(r) for r in
                _requests(args, prompt=args.prompt, steps=args.steps, guidance=args.guidance, seed=args.seed)]
    check_output_folder(args.out)
    progress = TerminalProgress()
    for request in requests:
        for run in range(args.repeat):
            result = manager.generate(request, progress)
            r = result.request
            if result.note and run == 0 and not args.json:
                print(f"note: {result.note}", file=sys.stderr, flush=True)
            for i, image in enumerate(result.images):
                path = args.out / f"{r.model}-{r.hardware}-{r.mode}-{r.width}x{r.height}-seed{r.seed}-{run}-{i}.png"
                image.save(path)
                facts = {**result.facts(), "path": str(path)}
                if args.json:
                    print(json.dumps(facts), flush=True)
                else:
                    print(f"{path}: {r.width}x{r.height} in {result.seconds:.3f} s "
                          f"(compile {result.compile_seconds:.2f} s, {result.new_graphs} new graphs, "
                          f"{'warm' if result.warm else 'first visit'})", flush=True)
    return 0


def cmd_cache(args) -> int:
    from .executors.artifacts import ArtifactStore
    from .hardware import HARDWARE

    def here(hardware: str) -> str | None:
        adapter = HARDWARE.get(hardware)
        return adapter.toolchain() if adapter is not None and adapter.detect().available else None

    store = ArtifactStore.of(config.settings())
    removed = store.prune(here) if args.prune else []
    packages = store.packages()
    if args.json:
        print(json.dumps({"folder": str(store.root), "packages": packages, "removed": removed}, indent=2))
        return 0
    print(f"{len(packages)} precompiled package(s) in {store.root}")
    for entry in packages:
        print(f"  {entry.get('model', '?'):<17} {entry.get('hardware', '?'):<5} {entry.get('shape') or '?':<9} "
              f"{entry['megabytes']:>7.2f} MB  {entry.get('age_days', 0):>5.1f} d  {entry.get('toolchain', 'no JSON')}")
    for path in removed:
        print(f"  removed {path}")
    return 0


def cmd_warmup(args, manager) -> int:
    base = manager.check(_requests(args)[0])
    shapes = args.sizes or [base.shape]
    for record in manager.warm_up(base, shapes, TerminalProgress()):
        facts = {"shape": str(record.shape), "state": record.state, "graphs": record.graphs,
                 "compile_seconds": round(record.compile_seconds, 3), "first_call_seconds": record.first_call_seconds}
        print(json.dumps(facts) if args.json else
              f"{record.shape}: {record.state}, {record.graphs} graphs, compile {record.compile_seconds:.2f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "info":
            return cmd_info(args)
        if args.command == "bench":
            return cmd_bench(args)
        if args.command == "cache":
            return cmd_cache(args)
        from .engine import SessionManager
        from .executors.routing import RoutingExecutor

        settings = config.settings()
        manager = SessionManager(settings, RoutingExecutor(settings))
        try:
            return {"generate": cmd_generate, "warmup": cmd_warmup}[args.command](args, manager)
        finally:
            manager.close()
    except AcceldemoError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
