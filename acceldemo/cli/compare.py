"""`python -m acceldemo compare`: one prompt and seed under two configurations, side by side."""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import InvalidRequest
from ..records import GenerateParams
from .common import TerminalProgress, check_output_folder, download_arg, shape_arg

HELP = "one prompt and seed under two configurations, side by side: times, the speed ratio, how far apart the " \
       "pictures are"
# A comparison side's keys, as the CLI takes them (`tp` is tp_size, `cp` cp_size, `step-cache` step_cache).
COMPARE_KEYS = ("hardware", "mode", "placement", "tp", "cp", "step_cache", "quantization", "steps")


def add_parser(commands) -> None:
    compare = commands.add_parser("compare", help=HELP, description=HELP)
    compare.add_argument("--prompt", required=True, help="what to draw, on both sides")
    compare.add_argument("--model", help="catalog model (default: the embedded tiny model)")
    compare.add_argument("--size", type=shape_arg, metavar="WxH", help="image size (default: the model's)")
    compare.add_argument("--seed", type=int, help="default: a random seed, the same for both sides")
    compare.add_argument("--steps", type=int, help="both sides' steps (a side may set its own; default: the model's)")
    for side in ("a", "b"):
        compare.add_argument(f"--{side}", default="", metavar="KEY=VALUE,...",
                             help=f"side {side.upper()}'s configuration: {', '.join(COMPARE_KEYS)} (e.g. "
                                  "mode=compiled,step_cache=taylorseer); unset keys take the defaults (default: "
                                  "every key's default)")
    compare.add_argument("--out", type=Path, default=Path("outputs"), help="folder for the two PNGs (default outputs/)")
    compare.add_argument("--json", action="store_true", help="the figures as one JSON object on stdout")
    download_arg(compare)


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
    from ..engine.compare import configuration

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
