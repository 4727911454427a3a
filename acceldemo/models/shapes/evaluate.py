"""Score the shapes model on held-out captions: `python -m acceldemo.models.shapes.evaluate --model DIR`.

Three rows, each judged by `judge.py`:
- ground truth: the held-out scenes drawn by `dataset.render` (checks the judge itself);
- VAE round trip: those drawings encoded and decoded (the ceiling the VAE leaves);
- generated: the held-out captions through the stock `Flux2KleinPipeline.__call__`.
"""
from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

import torch
from diffusers import Flux2KleinPipeline
from PIL import Image

from . import RECOMMENDED_STEPS
from .dataset import Scene, held_out_scenes, images_as_tensor, render
from .judge import judge


def accuracy(images: list[Image.Image], scenes: list[Scene]) -> dict[str, float]:
    """Fraction of images whose judged colour, background, both colours, position and shape are right."""
    hits: Counter[str] = Counter()
    for image, scene in zip(images, scenes, strict=True):
        hits.update({part: int(right) for part, right in judge(image).matches(scene).items()})
    return {part: hits[part] / len(scenes) for part in sorted(hits)}


def generate(
    pipe: Flux2KleinPipeline, scenes: list[Scene], seed: int, steps: int = RECOMMENDED_STEPS, batch_size: int = 32
) -> list[Image.Image]:
    """One 64×64 image per scene, image i drawn from torch.Generator("cpu").manual_seed(seed + i)."""
    images: list[Image.Image] = []
    for start in range(0, len(scenes), batch_size):
        chunk = scenes[start : start + batch_size]
        images += pipe(
            prompt=[scene.caption for scene in chunk],
            height=64,
            width=64,
            num_inference_steps=steps,
            guidance_scale=1.0,  # distilled: guidance is ignored, 1.0 just keeps the pipeline from warning
            generator=[torch.Generator("cpu").manual_seed(seed + start + i) for i in range(len(chunk))],
        ).images
    return images


@torch.no_grad()
def vae_round_trip(pipe: Flux2KleinPipeline, images: list[Image.Image]) -> list[Image.Image]:
    latents = pipe.vae.encode(images_as_tensor(images)).latent_dist.mode()
    decoded = pipe.vae.decode(latents).sample
    return pipe.image_processor.postprocess(decoded, output_type="pil")


def evaluate(model_dir: Path, steps: int, images_per_caption: int) -> dict:
    torch.set_num_threads(1)
    pipe = Flux2KleinPipeline.from_pretrained(model_dir)
    pipe.set_progress_bar_config(disable=True)
    scenes = held_out_scenes()
    drawn_scenes = scenes * images_per_caption
    drawn = [render(scene, seed=10_000 + i) for i, scene in enumerate(drawn_scenes)]

    started = time.monotonic()
    generated = [
        image
        for round_ in range(images_per_caption)
        for image in generate(pipe, scenes, seed=round_ * len(scenes), steps=steps)
    ]
    seconds = time.monotonic() - started
    return {
        "model": str(model_dir),
        "held_out_captions": len(scenes),
        "images_per_caption": images_per_caption,
        "num_inference_steps": steps,
        "ground_truth": accuracy(drawn, drawn_scenes),
        "vae_round_trip": accuracy(vae_round_trip(pipe, drawn), drawn_scenes),
        "generated": accuracy(generated, drawn_scenes),
        "seconds_per_generated_image": round(seconds / len(generated), 4),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="a saved Flux2KleinPipeline folder")
    parser.add_argument("--steps", type=int, default=RECOMMENDED_STEPS, help="num_inference_steps")
    parser.add_argument("--images-per-caption", type=int, default=2, help="images per held-out caption")
    parser.add_argument("--json", type=Path, help="where to write the figures (default: MODEL/evaluation.json)")
    args = parser.parse_args(argv)
    report = evaluate(args.model, args.steps, args.images_per_caption)
    text = json.dumps(report, indent=2)
    print(text)
    (args.json or args.model / "evaluation.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
