"""`python -m acceldemo generate`: images, each size in order, --repeat times each, as PNGs in a folder."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from ..errors import InvalidRequest
from .common import (
    TerminalProgress,
    artifacts_arg,
    check_output_folder,
    download_arg,
    lora_option,
    read_picture,
    request_args,
    request_params,
)

HELP = "generate images, each size in order, --repeat times each"


def add_parser(commands) -> None:
    generate = commands.add_parser("generate", help=HELP, description=HELP)
    generate.add_argument("--prompt", required=True, help="what to draw")
    request_args(generate)
    generate.add_argument("--steps", type=int, help="denoise steps (default: the model's)")
    generate.add_argument("--guidance", type=float, help="guidance scale (default: the model's)")
    generate.add_argument("--seed", type=int, help="default: a random seed (each image's is in its facts)")
    generate.add_argument("--repeat", type=int, default=1, help="runs per size (default 1)")
    generate.add_argument("--out", type=Path, default=Path("outputs"), help="folder for the PNGs (default outputs/)")
    generate.add_argument("--json", action="store_true", help="one JSON line per image on stdout")
    generate.add_argument("--image", type=Path, action="append", dest="images", metavar="PATH",
                          help="edit this picture (PNG, JPEG, WebP; repeat for reference images where the model "
                               "takes several); without --size: the picture's size or the model's nearest (default: "
                               "none, a new picture)")
    generate.add_argument("--mask", type=Path, metavar="PATH",
                          help="with --image: a PNG, transparent where the picture may change (models that inpaint; "
                               "default: none, the whole picture may change)")
    generate.add_argument("--strength", type=float, help="with --image: how much changes, (0, 1] (default 0.8)")
    generate.add_argument("--lora", metavar="NAME[:SCALE]",
                          help="a LoRA style of the model (`info` lists them) and its strength (default: none; "
                               "scale default 1)")
    generate.add_argument("--previews", type=Path, metavar="DIR",
                          help="also save each denoise step's preview of the image forming, as PNGs in DIR "
                               "(default: none)")
    artifacts_arg(generate)
    download_arg(generate)


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
                request_params(args, prompt=args.prompt, steps=args.steps, guidance=args.guidance, seed=args.seed,
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
