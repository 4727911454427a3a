"""The `outline` style LoRA of the shapes model: loaded, the pipeline draws the captioned scene as an outline; unloaded, filled as before.

Eager diffusers only (no app code): the committed pipeline, `load_lora_weights` of the committed file,
held-out captions (scenes training never drew, in either style), judged by `judge.is_outline` and `judge.judge`.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import Flux2KleinPipeline
from PIL import Image

from acceldemo.models.shapes import (
    RECOMMENDED_MAX_SEQUENCE_LENGTH,
    RECOMMENDED_STEPS,
    TRAINED_SIZES,
    trained_model_dir,
)
from acceldemo.models.shapes.phrasing import CANONICAL_FAMILY
from training.shapes.dataset import all_scenes, held_out_captions, render
from training.shapes.judge import hollowness, is_outline, judge

pytestmark = pytest.mark.heavy  # draws with the real model: outside the quick tier, run in CI

OUTLINE_LORA = trained_model_dir().parent / "loras" / "outline.safetensors"
# One caption per held-out scene (all four parts named; scenes training never drew, in either style), seed i
# for caption i as in `training.shapes.evaluate`: 20 circles, 20 squares, 20 triangles.
CAPTIONS = held_out_captions(CANONICAL_FAMILY, 60)
DRAWN_SIZES = ((64, 64), (128, 64))
# The share of outlines wanted, by size. Triangles hold them back: their hollow (3 px stroke, inradius
# 6.8 px) is the smallest, and even the VAE's own round trip of drawn outline triangles keeps it in only
# 80 % (64x64) and 73-76 % (128 px) of them. The committed LoRA: 92 % at 64x64, 88 % at 128x64 and
# 64x128, 82 % at 128x128 (circles and squares 94-100 %, triangles 59-77 %; loras/README.md).
OUTLINE_SHARE = {(64, 64): 0.9, (128, 64): 0.85}


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """On a busy 2-core host, 2 threads run this tiny model many times slower than 1."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("size", TRAINED_SIZES, ids=lambda size: f"{size[0]}x{size[1]}")
def test_the_judge_tells_outlines_from_filled_shapes_on_drawn_scenes_at_every_size(size):
    for index, scene in enumerate(all_scenes()[::9]):
        filled, outline = render(scene, *size, seed=index), render(scene, *size, seed=index, style="outline")
        assert not is_outline(filled), (scene, size, hollowness(filled))
        assert is_outline(outline), (scene, size, hollowness(outline))
        # The outline is still read as the scene's colours and position.
        verdict = judge(outline).matches(scene)
        assert verdict["colours"] and verdict["position"], (scene, size, judge(outline))


def test_the_default_drawing_is_the_filled_one():
    scene = all_scenes()[7]
    assert render(scene, 64, 64, seed=3).tobytes() == render(scene, 64, 64, seed=3, style="filled").tobytes()
    assert render(scene, 64, 64, seed=3).tobytes() != render(scene, 64, 64, seed=3, style="outline").tobytes()
    with pytest.raises(ValueError, match="unknown style"):
        render(scene, style="dotted")


def test_the_lora_file_is_at_most_one_megabyte():
    assert OUTLINE_LORA.stat().st_size <= 1_000_000


@pytest.fixture(scope="module")
def pipe() -> Flux2KleinPipeline:
    pipe = Flux2KleinPipeline.from_pretrained(trained_model_dir())
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _draw(pipe: Flux2KleinPipeline, size: tuple[int, int]) -> list[Image.Image]:
    width, height = size
    return pipe(
        prompt=[caption.text for caption in CAPTIONS],
        width=width,
        height=height,
        num_inference_steps=RECOMMENDED_STEPS,
        guidance_scale=1.0,
        max_sequence_length=RECOMMENDED_MAX_SEQUENCE_LENGTH,
        generator=[torch.Generator("cpu").manual_seed(i) for i in range(len(CAPTIONS))],
    ).images


@pytest.fixture(scope="module")
def drawn(pipe) -> dict[tuple[str, tuple[int, int]], list[Image.Image]]:
    """Every drawing the tests judge, by (with the LoRA at strength 1 / 0.5 / unloaded, size)."""
    images = {}
    pipe.load_lora_weights(OUTLINE_LORA, adapter_name="outline")
    for size in DRAWN_SIZES:
        images["outline", size] = _draw(pipe, size)
    pipe.set_adapters(["outline"], [0.5])
    images["half", DRAWN_SIZES[0]] = _draw(pipe, DRAWN_SIZES[0])
    pipe.unload_lora_weights()
    for size in DRAWN_SIZES:
        images["filled", size] = _draw(pipe, size)
    return images


def _share(flags) -> float:
    flags = list(flags)
    return sum(flags) / len(flags)


@pytest.mark.parametrize("size", DRAWN_SIZES, ids=lambda size: f"{size[0]}x{size[1]}")
def test_with_the_lora_held_out_captions_are_drawn_as_outlines_of_the_asked_scene(drawn, size):
    images = drawn["outline", size]
    outlines = [is_outline(image) for image in images]
    assert _share(outlines) >= OUTLINE_SHARE[size], [(c.text, round(hollowness(i) or 0, 2)) for c, i, o in zip(CAPTIONS, images, outlines) if not o]
    placed = [judge(image).matches(caption) for image, caption in zip(images, CAPTIONS, strict=True)]
    assert _share(verdict["colours"] and verdict["position"] for verdict in placed) >= 0.8, [
        (caption.text, judge(image)) for caption, image, verdict in zip(CAPTIONS, images, placed)
        if not (verdict["colours"] and verdict["position"])
    ]


@pytest.mark.parametrize("size", DRAWN_SIZES, ids=lambda size: f"{size[0]}x{size[1]}")
def test_unloaded_the_same_captions_are_drawn_filled_as_before(drawn, size):
    images = drawn["filled", size]
    assert _share(not is_outline(image) for image in images) >= 0.9
    assert _share(all(judge(image).matches(caption).values()) for image, caption in zip(images, CAPTIONS)) >= 0.8


def test_at_half_strength_the_lora_changes_the_drawing_part_way(drawn):
    def mean_hollowness(images):
        return float(np.mean([hollowness(image) or 0.0 for image in images]))

    size = DRAWN_SIZES[0]
    filled, half, outline = (mean_hollowness(drawn[kind, size]) for kind in ("filled", "half", "outline"))
    assert filled < half < outline, (filled, half, outline)
