"""The command line: `python -m acceldemo info | generate | warmup | bench`, headless, on the same engine as the UI."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

from .bench import add_arguments as add_bench_arguments
from .bench import cmd_bench
from .config import Settings, store_url
from .errors import AcceldemoError, InvalidRequest
from .hardware import all_modes, hardware_names, prepare_process
from .models.caches import STEP_CACHE_CHOICES
from .records import GenerateParams, Phase, Placement, Progress, Quantization, Shape


def _shape(text: str) -> Shape:
    shape = Shape.parse(text)
    if shape is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: write WIDTHxHEIGHT, e.g. 1024x1024")
    return shape


class TerminalProgress:
    """Progress events as terminal lines; denoise steps overwrite one line on a terminal."""

    def __init__(self, stream=sys.stderr, previews: Path | None = None):
        self.stream = stream
        self.started = time.perf_counter()
        self.tty = stream.isatty()
        self.last = ""
        # Where each preview goes as a PNG (`--previews DIR`), named `{preview_name}-{image}-step{step}.png`.
        self.previews = previews
        self.preview_name = "preview"

    def __call__(self, event: Progress) -> None:
        elapsed = time.perf_counter() - self.started
        text = f"[{elapsed:7.2f}s] {event.phase:<8} {event.message}"
        if event.preview is not None and self.previews is not None:
            event.preview.image().save(self.previews / f"{self.preview_name}-{event.image}-step{event.step:03d}.png")
        again, self.last = event.message == self.last, event.message
        if event.phase is Phase.COMPILE and again:  # the same compile a second later: on a terminal, its clock
            if self.tty and event.expected:
                self.stream.write(f"{text} [{event.elapsed:.0f} of about {event.expected:.0f} s]\r")
        elif event.phase is Phase.DENOISE and self.tty:
            end = "\n" if event.step == event.total else "\r"
            self.stream.write(text + end)
        elif event.phase is not Phase.DENOISE or event.step == event.total:
            self.stream.write(text + "\n")
        self.stream.flush()


def _request_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="catalog model (default: the embedded tiny model); see `info`")
    parser.add_argument("--hardware", choices=hardware_names(),
                        help="default: the first accelerator found, else cpu")
    parser.add_argument("--device", help="a device (cuda:1) or group (neuron:0-1) to run on; default: any free one")
    parser.add_argument("--mode", choices=[str(m) for m in all_modes()], help="default: eager")
    parser.add_argument("--placement", choices=[str(p) for p in Placement],
                        help="default: proposed from the model size and device memory")
    parser.add_argument("--tp", type=int, dest="tp_size", help="tensor-parallel world size with --placement tp")
    parser.add_argument("--cp", type=int, dest="cp_size",
                        help="context-parallel degree with --placement cp (ranks the image tokens are spread over)")
    parser.add_argument("--size", type=_shape, action="append", dest="sizes", metavar="WxH",
                        help="image size; repeat for several (default: the model's)")
    parser.add_argument("--quantization", choices=[str(q) for q in Quantization],
                        help="weights: none (default), int8 (torchao weight-only, any hardware), fp8 (CUDA sm_89+)")
    parser.add_argument("--step-cache", dest="step_cache", metavar="NAME",
                        help=f"reuse work across denoise steps: {', '.join(STEP_CACHE_CHOICES)} (auto: the model's "
                             "advice; `info` lists what each model offers and why others are refused)")


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
    generate.add_argument("--seed", type=int, help="default: a random seed (each image's is in its facts)")
    generate.add_argument("--repeat", type=int, default=1, help="runs per size (default 1)")
    generate.add_argument("--out", type=Path, default=Path("outputs"), help="folder for the PNGs (default outputs/)")
    generate.add_argument("--json", action="store_true", help="one JSON line per image on stdout")
    generate.add_argument("--image", type=Path, action="append", dest="images", metavar="PATH",
                          help="edit this picture (PNG, JPEG, WebP; repeat for reference images where the model "
                               "takes several); without --size: the picture's size or the model's nearest")
    generate.add_argument("--mask", type=Path, metavar="PATH",
                          help="with --image: a PNG, transparent where the picture may change (models that inpaint)")
    generate.add_argument("--strength", type=float, help="with --image: how much changes, (0, 1] (default 0.8)")
    generate.add_argument("--lora", metavar="NAME[:SCALE]",
                          help="a LoRA style of the model (`info` lists them) and its strength (default 1)")
    generate.add_argument("--previews", type=Path, metavar="DIR",
                          help="also save each denoise step's preview of the image forming, as PNGs in DIR")

    warmup = commands.add_parser("warmup", help="compile shapes ahead of requests and report their cost")
    _request_args(warmup)
    warmup.add_argument("--batch", type=int, action="append", dest="batches", metavar="N",
                        help="also compile calls drawing N requests together (a compiled mode's bucket, e.g. --batch 2 "
                             "--batch 4); repeat for several (default: 1)")
    warmup.add_argument("--json", action="store_true", help="one JSON line per shape and batch on stdout")
    warmup.add_argument("--push", action="store_true",
                        help="publish the compiled packages to the shared artifact store (--artifacts), also those "
                             "that were already in the local cache, so serving hosts never compile them")

    cache = commands.add_parser("cache", help="list the precompiled packages here and in the shared artifact store; "
                                              "--verify checks the store's checksums, --prune removes what is unusable")
    cache.add_argument("--verify", action="store_true",
                       help="download every artifact of the shared store and check it against its manifest")
    cache.add_argument("--prune", action="store_true",
                       help="delete local packages built by another torch/CPU/GPU toolchain and leftovers of killed "
                            "builds; in the shared store, manifests whose object is missing, objects no manifest "
                            "names (older than --grace) and, with --verify, artifacts that fail their checksum")
    cache.add_argument("--grace", type=float, default=3600.0, metavar="SECONDS",
                       help="age under which an object without a manifest is left alone: an upload may be in flight "
                            "(default 3600)")
    cache.add_argument("--json", action="store_true", help="one JSON object instead of text")
    for command in (generate, warmup, cache):
        command.add_argument("--artifacts", metavar="URL",
                             help="the shared artifact store: a shared folder, s3://bucket/prefix, gs://bucket/prefix "
                                  "or hf://datasets/ORG/NAME (env ACCELDEMO_ARTIFACTS; options: "
                                  "ACCELDEMO_ARTIFACTS_OPTIONS)")

    compare = commands.add_parser("compare", help="one prompt and seed under two configurations, side by side: times, "
                                                  "the speed ratio, how far apart the pictures are")
    compare.add_argument("--prompt", required=True)
    compare.add_argument("--model", help="catalog model (default: the embedded tiny model)")
    compare.add_argument("--size", type=_shape, metavar="WxH", help="image size (default: the model's)")
    compare.add_argument("--seed", type=int, help="default: a random seed, the same for both sides")
    compare.add_argument("--steps", type=int, help="both sides' steps (a side may set its own)")
    for side in ("a", "b"):
        compare.add_argument(f"--{side}", default="", metavar="KEY=VALUE,...",
                             help=f"side {side.upper()}'s configuration: {', '.join(COMPARE_KEYS)} (e.g. "
                                  "mode=compiled,step_cache=taylorseer); unset keys take the defaults")
    compare.add_argument("--out", type=Path, default=Path("outputs"), help="folder for the two PNGs (default outputs/)")
    compare.add_argument("--json", action="store_true", help="the figures as one JSON object on stdout")
    for command in (generate, warmup, compare):
        command.add_argument("--download", action="store_true",
                             help="fetch a real model missing here from the Hugging Face Hub (env ACCELDEMO_DOWNLOAD; "
                                  "HF_TOKEN for gated repositories)")

    plan = commands.add_parser("plan", help="what a model would get on a host you may not have: placement, degrees, "
                                            "memory per device, modes, batch cap")
    plan.add_argument("--model", action="append", dest="models", metavar="NAME",
                      help="catalog model; repeat for several (default: every real model)")
    plan.add_argument("--host", help="a host kind (trn2.48xlarge, v6e-4, h100x8, ...; `--host list` names them all)")
    plan.add_argument("--hardware", choices=hardware_names(), help="or describe the host: its hardware ...")
    plan.add_argument("--devices", type=int, help="... its devices (NeuronCores, chips, GPUs) ...")
    plan.add_argument("--device-memory", dest="device_memory", metavar="SIZE", help="... memory per device (24GB)")
    plan.add_argument("--generation", default="", help="... and, for TPU, the chip generation (TPU v6e)")
    plan.add_argument("--quantization", choices=[str(q) for q in Quantization], default="none")
    plan.add_argument("--size", type=_shape, metavar="WxH", help="the image size to plan for (default: the model's)")
    plan.add_argument("--json", action="store_true", help="one JSON object per model")

    bench = commands.add_parser("bench", help="measure manager, pool, restart, compile and serving costs as ratios")
    add_bench_arguments(bench)
    return parser


def cmd_info(args, engine) -> int:
    from .engine import as_json

    description = engine.describe()
    if args.json:
        print(json.dumps(as_json(description), indent=2))
        return 0
    print("Hardware")
    for h in description.hardware:
        mark = "found " if h.available else "absent"
        print(f"  {h.name:<7} {mark}  {h.reason}" + (f"  modes: {', '.join(h.modes)}" if h.available else ""))
        for device in h.devices:
            print(f"    {str(device):<9} {device.memory_bytes / 1e9:>7.1f} GB  {device.detail}".rstrip())
    print(f"Models (default {description.default_model})")
    for m in description.models:
        print(f"  {m.name:<17} {m.pipeline:<25} {m.steps:>2} steps, guidance {m.guidance}, "
              f"default {m.default_size}, presets {' '.join(map(str, m.presets))}")
        print(f"      edits by {m.edits}" + (" (takes a mask)" if m.inpaints else "") + "; LoRA styles: "
              + (", ".join(f"{style['name']} (rank {style['rank']})" for style in m.loras) or "none"))
        offered = [c["name"] + (" (eager only)" if c["eager_only"] else "") for c in m.step_caches if not c["refused"]]
        print(f"      step caches: {', '.join(offered) or 'none'}; auto: {m.cache_advice['cache']} "
              f"(from {m.cache_advice['from_steps']} steps); not: "
              + "; ".join(f"{c['name']} ({c['refused']})" for c in m.step_caches if c["refused"]))
        for offer in m.offers:
            refused = [f"{o.name} ({o.reason})" for o in offer.modes if not o.ok]
            print(f"      on {offer.hardware}: placement {offer.proposal.placement} ({offer.proposal.reason}; "
                  f"up to {offer.proposal.batch} requests per call)"
                  + (f"; not: {'; '.join(refused)}" if refused else ""))
            print("        weights: " + ", ".join(f"{q['name']} {q['weight_bytes'] / 1e9:.3g} GB"
                                                  + (f" (not here: {q['refused']})" if q["refused"] else "")
                                                  for q in offer.quantizations))
    packages = description.precompiled
    print(f"Precompiled packages ({packages['setting']}): {packages['packages']} in {packages['folder']} "
          f"({packages['megabytes']} MB)")
    if packages.get("store"):
        print(f"Shared artifact store: {packages['store']['url']}")
    return 0


def _params(args, prompt: str = "warm-up", **extra) -> list[GenerateParams]:
    """One raw request per --size (the model's default size without one)."""
    return [GenerateParams(prompt=prompt, model=args.model, hardware=args.hardware, mode=args.mode,
                           placement=args.placement, tp_size=args.tp_size, cp_size=args.cp_size, device=args.device,
                           resolution=size,
                           quantization=args.quantization, step_cache=args.step_cache, **extra)
            for size in args.sizes or [None]]


def check_output_folder(folder: Path, field: str = "out") -> Path:
    """The folder for the images, created now and proved writable, so no image is made only to be lost."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".acceldemo-write-check-"):
            pass
    except OSError as error:
        raise InvalidRequest(field, str(folder), f"a folder this user can create and write to "
                                                 f"({error.strerror or type(error).__name__})") from None
    return folder


def read_picture(path: Path, field: str) -> bytes:
    """A picture file's bytes (at most one past the engine's limit, which it then refuses by size)."""
    from .engine.pictures import MAX_IMAGE_BYTES

    try:
        with open(path, "rb") as file:
            return file.read(MAX_IMAGE_BYTES + 1)
    except OSError as error:
        raise InvalidRequest(field, str(path), f"a picture file this user can read ({error.strerror or error})") \
            from None


def lora_option(text: str | None) -> dict:
    """--lora NAME[:SCALE] as the request's lora and lora_scale."""
    if not text:
        return {}
    name, _, scale = text.rpartition(":") if ":" in text else (text, "", "")
    return {"lora": name, "lora_scale": scale or None}


def cmd_generate(args, engine) -> int:
    if args.repeat < 1:
        raise InvalidRequest("repeat", args.repeat, "a whole number of at least 1")
    edit = {}
    if args.images:
        edit = {"image": [read_picture(path, "image") for path in args.images], "strength": args.strength,
                "mask": read_picture(args.mask, "mask") if args.mask else None}
    elif args.mask or args.strength is not None:
        raise InvalidRequest("mask" if args.mask else "strength", "given without --image", "only with --image PATH")
    requests = [engine.check(params) for params in
                _params(args, prompt=args.prompt, steps=args.steps, guidance=args.guidance, seed=args.seed,
                        previews=args.previews is not None, **edit, **lora_option(args.lora))]
    check_output_folder(args.out)
    if args.previews is not None:
        check_output_folder(args.previews, "previews")
    progress = TerminalProgress(previews=args.previews)
    for request in requests:
        for run in range(args.repeat):
            r = request
            progress.preview_name = f"{r.model}-{r.hardware}-{r.mode}-{r.width}x{r.height}-seed{r.seed}-{run}"
            result = engine.generate(request, progress)
            r = result.request
            if result.note and run == 0 and not args.json:
                print(f"note: {result.note}", file=sys.stderr, flush=True)
            for i, image in enumerate(result.images):
                style = f"-{r.lora}{r.lora_scale:g}" if r.lora else ""
                kind = f"-edit{r.edit.strength:g}" if r.edit else ""
                path = args.out / (f"{r.model}-{r.hardware}-{r.mode}-{r.width}x{r.height}{kind}{style}-seed{r.seed}-"
                                   f"{run}-{i}.png")
                image.save(path)
                facts = {**result.facts(), "path": str(path)}
                if args.json:
                    print(json.dumps(facts), flush=True)
                else:
                    print(f"{path}: {r.width}x{r.height} in {result.seconds:.3f} s "
                          f"(compile {result.compile_seconds:.2f} s, {result.new_graphs} new graphs, "
                          f"{'warm' if result.warm else 'first visit'})", flush=True)
    return 0


# A comparison side's keys, as the CLI takes them (`tp` is tp_size, `cp` cp_size, `step-cache` step_cache).
COMPARE_KEYS = ("hardware", "mode", "placement", "tp", "cp", "step_cache", "quantization", "steps")


def side_params(text: str, field: str, **shared) -> GenerateParams:
    """`KEY=VALUE,...` as one side's raw request on top of the shared values; an unknown key is refused by name."""
    values: dict[str, object] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        key, sep, value = part.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in COMPARE_KEYS:
            raise InvalidRequest(field, part, f"KEY=VALUE with KEY one of {', '.join(COMPARE_KEYS)}")
        values[{"tp": "tp_size", "cp": "cp_size"}.get(key, key)] = value.strip()
    return GenerateParams(**{**shared, **values})


def cmd_compare(args, engine) -> int:
    from .engine.compare import configuration

    shared = dict(prompt=args.prompt, model=args.model, resolution=args.size, seed=args.seed, steps=args.steps)
    first, second = side_params(args.a, "a", **shared), side_params(args.b, "b", **shared)
    check_output_folder(args.out)
    comparison = engine.submit_comparison(first, second, TerminalProgress()).result()
    paths = []
    for name, result in (("a", comparison.first), ("b", comparison.second)):
        r = result.request
        path = args.out / f"compare-{r.model}-{r.width}x{r.height}-seed{r.seed}-{name}.png"
        result.image.save(path)
        paths.append(str(path))
    facts = {**comparison.facts(), "paths": paths}
    if args.json:
        print(json.dumps(facts))
        return 0
    sides = facts["sides"]

    def row(label: str, values: list[object]) -> None:
        print(f"{label:<22} {str(values[0]):<44} {values[1]}")

    print(f"{facts['model']} · {facts['size']} · seed {facts['seed']} · {facts['prompt']!r}")
    row("", ["A", "B"])
    row("configuration", [configuration(r.request) for r in (comparison.first, comparison.second)])
    row("total s", [side["total_seconds"] for side in sides])
    row("compile s", [side["compile_seconds"] for side in sides])
    row("denoise s", [side["denoise_seconds"] for side in sides])
    row("transformer calls", [f"{side['step_cache']['calls']} ({side['step_cache']['skipped']} skipped)"
                              for side in sides])
    row("weights MB", [round(side["weight_bytes"] / 1e6, 2) for side in sides])
    row("image", paths)
    speed = f"{facts['speedup']}x total" if facts["speedup"] else "n/a"
    if facts["denoise_speedup"]:
        speed += f", {facts['denoise_speedup']}x denoise"
    print(f"B's speed ÷ A's: {speed}")
    print(f"difference: mean |A-B| {facts['mean_abs_difference']}/255, PSNR "
          + ("identical" if facts["identical"] else f"{facts['psnr_db']} dB"))
    return 0


def cmd_plan(args, settings: Settings) -> int:
    from .engine.planning import described_host, named_host, plan
    from .hardware import host_kinds
    from .models.catalog import CATALOG, get_model

    if args.host == "list":
        for kind in host_kinds().values():
            print(f"{kind.name:<15} {kind.hardware:<7} {kind.devices:>3} x {kind.memory_bytes / 1e9:6.1f} GB  "
                  f"{kind.detail}")
        return 0
    if args.host and args.hardware:
        raise InvalidRequest("host", args.host, "either --host NAME or --hardware/--devices/--device-memory, not both")
    if args.host:
        host = named_host(args.host)
    elif args.hardware and args.devices and args.device_memory:
        host = described_host(args.hardware, args.devices, args.device_memory, args.generation)
    else:
        raise InvalidRequest("host", None, "--host NAME (`--host list`) or --hardware HW --devices N "
                                           "--device-memory SIZE")
    specs = [get_model(name) for name in args.models] if args.models else \
        [spec for spec in CATALOG.values() if spec.repo]
    for spec in specs:
        planned = plan(spec, host, settings, Quantization(args.quantization), args.size)
        print(json.dumps(planned.facts()) if args.json else "\n".join(planned.lines()))
    return 0


def cmd_cache(args, settings: Settings) -> int:
    from .executors.artifacts import ArtifactStore
    from .hardware import HardwareRegistry

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
        print(f"  {about.get('model', entry['name']):<17} {about.get('hardware', ''):<5} "
              f"{about.get('shape', ''):<9} {(entry.get('bytes') or 0) / 2**20:>7.2f} MB  "
              f"{about.get('toolchain', '')}  {state}".rstrip())
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


def cmd_warmup(args, engine) -> int:
    if args.push and engine.artifacts.remote is None:
        raise InvalidRequest("push", True, "a shared artifact store to publish to: --artifacts URL or "
                                           "ACCELDEMO_ARTIFACTS")
    records = engine.warm_up(_params(args)[0], args.sizes, TerminalProgress(), args.batches or (1,))
    for record in records:
        facts = {"shape": str(record.shape), "batch": record.batch, "state": record.state, "graphs": record.graphs,
                 "compile_seconds": round(record.compile_seconds, 3), "first_call_seconds": record.first_call_seconds}
        batch = f" ×{record.batch}" if record.batch > 1 else ""
        print(json.dumps(facts) if args.json else
              f"{record.shape}{batch}: {record.state}, {record.graphs} graphs, compile {record.compile_seconds:.2f} s")
    if args.push:
        # Packages built just now are published already; this adds those the local cache held before.
        asked = engine.check(_params(args)[0])
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = Settings.from_env()
        if getattr(args, "artifacts", None):
            settings = dataclasses.replace(settings, artifacts=store_url(args.artifacts, "--artifacts"))
        if getattr(args, "download", False):
            settings = dataclasses.replace(settings, download=True)
        prepare_process(settings)
        if args.command == "bench":
            return cmd_bench(args, settings)
        if args.command == "cache":
            return cmd_cache(args, settings)
        if args.command == "plan":
            return cmd_plan(args, settings)
        from .builder import build_engine

        engine = build_engine(settings)
        try:
            return {"info": cmd_info, "generate": cmd_generate, "warmup": cmd_warmup,
                    "compare": cmd_compare}[args.command](args, engine)
        finally:
            engine.close()
    except (AcceldemoError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
