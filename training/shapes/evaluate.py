"""Score the shapes model on held-out captions at every size: `python -m training.shapes.evaluate --model DIR`.

Four checks, each judged by `judge.py` at each supported size:
- ground truth: the held-out scenes drawn by `dataset.render` (checks the judge itself);
- VAE round trip: those drawings encoded and decoded (the ceiling the VAE leaves);
- generated: held-out captions of every phrasing family through the stock
  `Flux2KleinPipeline.__call__`, scored per size × family on what each caption asks;
- held-out scenes: each held-out scene's template caption drawn with several seeds, so that one
  scene the model gets wrong half the time shows by name (one caption per scene would hide it
  as a few points in the family's figure).
`--grid PATH` instead draws the example prompts at every size into one PNG (the served sizes).
"""
from __future__ import annotations

import argparse
import json
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path

import torch
from diffusers import Flux2KleinPipeline
from PIL import Image, ImageDraw

from acceldemo.models.shapes import (
    RECOMMENDED_MAX_SEQUENCE_LENGTH,
    RECOMMENDED_STEPS,
    SIZES,
    TRAINED_SIZES,
    trained_model_dir,
)
from acceldemo.models.shapes.phrasing import EXAMPLE_PROMPTS, FAMILIES, Caption

from .dataset import Scene, held_out_captions, held_out_scenes, images_as_tensor, render
from .judge import judge

# Targets on held-out captions, per size and family, over the captions that ask for the part.
TARGETS = {"colours": 0.95, "position": 0.90, "shape": 0.90}
# A held-out scene holds at a size when at least this share of its seeds draws every part right.
SCENE_HOLDS = 0.75
_PART_ASKED = {
    "colours": lambda asked: asked.colour is not None or asked.background is not None,
    "position": lambda asked: asked.position is not None,
    "shape": lambda asked: True,
}


def accuracy(images: Sequence[Image.Image], asked: Sequence[Scene | Caption]) -> dict[str, float | None]:
    """Per part, the fraction of the images whose caption asks for it that got it right (None: never asked).

    "colours" is right when every colour the caption names (shape, background) is right.
    """
    hits: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    for image, wanted in zip(images, asked, strict=True):
        verdict = judge(image).matches(wanted)
        for part, is_asked in _PART_ASKED.items():
            if is_asked(wanted):
                counts[part] += 1
                hits[part] += verdict[part]
    return {part: hits[part] / counts[part] if counts[part] else None for part in _PART_ASKED}


def generate(
    pipe: Flux2KleinPipeline,
    prompts: Sequence[str],
    width: int,
    height: int,
    seed: int,
    steps: int = RECOMMENDED_STEPS,
    batch_size: int = 32,
    max_sequence_length: int = RECOMMENDED_MAX_SEQUENCE_LENGTH,
) -> list[Image.Image]:
    """One image per prompt, image i drawn from torch.Generator("cpu").manual_seed(seed + i)."""
    images: list[Image.Image] = []
    for start in range(0, len(prompts), batch_size):
        chunk = list(prompts[start : start + batch_size])
        images += pipe(
            prompt=chunk,
            height=height,
            width=width,
            num_inference_steps=steps,
            guidance_scale=1.0,  # distilled: guidance is ignored, 1.0 just keeps the pipeline from warning
            max_sequence_length=max_sequence_length,
            generator=[torch.Generator("cpu").manual_seed(seed + start + i) for i in range(len(chunk))],
        ).images
    return images


def scene_report(images: Sequence[Image.Image], scenes: Sequence[Scene]) -> dict:
    """Group the images by scene (any order, several per scene) and name the scenes that do not hold.

    Returns the share of scenes that hold, and for each weak scene (fewest right seeds first) its
    template caption, its right seeds of all, and how often each part was wrong.
    """
    verdicts: dict[Scene, list[dict[str, bool]]] = defaultdict(list)
    for image, scene in zip(images, scenes, strict=True):
        verdicts[scene].append(judge(image).matches(scene))
    weak = []
    for scene, judged in verdicts.items():
        right = sum(all(verdict[part] for part in TARGETS) for verdict in judged)
        if right < SCENE_HOLDS * len(judged):
            wrong = {part: sum(not verdict[part] for verdict in judged) for part in TARGETS}
            weak.append({"caption": scene.template_caption, "right": right,
                         "of": len(judged), "wrong": {part: count for part, count in wrong.items() if count}})
    weak.sort(key=lambda entry: (entry["right"] / entry["of"], entry["caption"]))
    return {"scenes": len(verdicts), "holding": 1 - len(weak) / len(verdicts), "weak": weak}


def held_out_scene_check(pipe: Flux2KleinPipeline, width: int, height: int, seeds: int, steps: int) -> dict:
    """Every held-out scene's template caption drawn `seeds` times at width×height, then `scene_report`."""
    scenes = held_out_scenes()
    prompts = [scene.template_caption for scene in scenes]
    images: list[Image.Image] = []
    for round_ in range(seeds):  # round r draws scene i from seed 1000 r + i
        images += generate(pipe, prompts, width, height, seed=1_000 * round_, steps=steps)
    return scene_report(images, scenes * seeds)


@torch.no_grad()
def vae_round_trip(pipe: Flux2KleinPipeline, images: list[Image.Image]) -> list[Image.Image]:
    latents = pipe.vae.encode(images_as_tensor(images)).latent_dist.mode()
    decoded = pipe.vae.decode(latents).sample
    return pipe.image_processor.postprocess(decoded, output_type="pil")


def load(model_dir: Path) -> Flux2KleinPipeline:
    pipe = Flux2KleinPipeline.from_pretrained(model_dir)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def evaluate(model_dir: Path, steps: int, captions_per_family: int, seeds_per_scene: int = 8) -> dict:
    torch.set_num_threads(1)
    pipe = load(model_dir)
    scenes = held_out_scenes()
    captions = {family: held_out_captions(family, captions_per_family) for family in FAMILIES}
    report: dict = {
        "model": str(model_dir),
        "num_inference_steps": steps,
        "held_out_captions_per_family": captions_per_family,
        "targets": TARGETS,
        "ground_truth": {},
        "vae_round_trip": {},
        "generated": {},
        "held_out_scenes": {},
    }
    started, generated_images = time.monotonic(), 0
    for width, height in TRAINED_SIZES:
        size = f"{width}x{height}"
        drawn = [render(scene, width, height, seed=10_000 + i) for i, scene in enumerate(scenes)]
        report["ground_truth"][size] = accuracy(drawn, scenes)
        report["vae_round_trip"][size] = accuracy(vae_round_trip(pipe, drawn), scenes)
        report["generated"][size] = {}
        for family, family_captions in captions.items():
            images = generate(pipe, [c.text for c in family_captions], width, height, seed=0, steps=steps)
            report["generated"][size][family] = accuracy(images, family_captions)
            generated_images += len(images)
        if seeds_per_scene:
            report["held_out_scenes"][size] = held_out_scene_check(pipe, width, height, seeds_per_scene, steps)
            generated_images += seeds_per_scene * len(scenes)
    report["seconds_per_generated_image"] = round((time.monotonic() - started) / generated_images, 4)
    report["meets_targets"] = {
        size: all(score is None or score >= TARGETS[part] for scores in families.values()
                  for part, score in scores.items())
        for size, families in report["generated"].items()
    }
    report["served_sizes"] = [f"{width}x{height}" for width, height in SIZES]
    return report


def markdown_table(report: dict) -> str:
    """The generated figures as a Markdown table: one row per size × family."""
    def cell(score: float | None) -> str:
        return "—" if score is None else f"{100 * score:.0f} %"

    lines = ["| size | phrasing family | colours | position | shape |", "|---|---|---|---|---|"]
    for size, families in report["generated"].items():
        for family, scores in families.items():
            lines.append(f"| {size} | {family} | {cell(scores['colours'])} | {cell(scores['position'])} | "
                         f"{cell(scores['shape'])} |")
    for size, check in report.get("held_out_scenes", {}).items():
        weak = "; ".join(f"{entry['caption']} ({entry['right']}/{entry['of']})" for entry in check["weak"]) or "none"
        lines.append(f"\n{size}: {100 * check['holding']:.0f} % of {check['scenes']} held-out scenes hold "
                     f"(≥ {100 * SCENE_HOLDS:.0f} % of seeds right); weak: {weak}")
    return "\n".join(lines)


def draw_grid(model_dir: Path, out: Path, prompts: Sequence[str] = EXAMPLE_PROMPTS, scale: int = 2) -> None:
    """The prompts (rows) at every supported size (columns), seed 0, each image enlarged `scale`× without smoothing."""
    torch.set_num_threads(1)
    pipe = load(model_dir)
    columns = [generate(pipe, prompts, width, height, seed=0) for width, height in SIZES]
    label_width, pad, header = 330, 12, 28
    cell_width = max(width for width, _ in SIZES) * scale
    cell_height = max(height for _, height in SIZES) * scale
    grid = Image.new("RGB", (label_width + len(SIZES) * (cell_width + pad),
                             header + len(prompts) * (cell_height + pad)), "white")
    draw = ImageDraw.Draw(grid)
    for column, (width, height) in enumerate(SIZES):
        draw.text((label_width + column * (cell_width + pad), 8), f"{width}x{height}", fill="black")
    for row, prompt in enumerate(prompts):
        top = header + row * (cell_height + pad)
        draw.text((8, top + cell_height // 2 - 6), f'"{prompt}"', fill="black")
        for column, images in enumerate(columns):
            image = images[row]
            grid.paste(image.resize((image.width * scale, image.height * scale), Image.Resampling.NEAREST),
                       (label_width + column * (cell_width + pad), top))
    out.parent.mkdir(parents=True, exist_ok=True)
    grid.save(out, optimize=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=trained_model_dir(), help="a saved Flux2KleinPipeline folder")
    parser.add_argument("--steps", type=int, default=RECOMMENDED_STEPS, help="num_inference_steps")
    parser.add_argument("--captions-per-family", type=int, default=60, help="held-out captions per family and size")
    parser.add_argument("--seeds-per-scene", type=int, default=8,
                        help="seeds per held-out scene for the per-scene check (0: skip it)")
    parser.add_argument("--json", type=Path, help="where to write the figures (default: MODEL/evaluation.json)")
    parser.add_argument("--grid", type=Path, help="draw the example prompts at every size into this PNG instead")
    args = parser.parse_args(argv)
    if args.grid:
        draw_grid(args.model, args.grid)
        return
    report = evaluate(args.model, args.steps, args.captions_per_family, args.seeds_per_scene)
    text = json.dumps(report, indent=2)
    print(text)
    print(markdown_table(report))
    (args.json or args.model / "evaluation.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
