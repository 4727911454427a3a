"""The synthetic shapes dataset: one flat shape on a flat background, drawn by code at any size, and its captions.

A scene is shape × shape colour × background colour × position (the two colours differ):
3 × 6 × 5 × 5 = 450 scenes. Positions are fractions of the frame; the shape is 22 pixels
across at every size (64×64, 128×128, 128×64 and 64×128), so it covers the same few latent
tokens everywhere. Each drawing jitters the size and the centre a little from a seeded
generator, so the same (scene, size, seed) always gives the same RGB image.

Captions come in phrasing families (`acceldemo.models.shapes.phrasing`); a caption may leave parts of its scene
out. Held-out split, checked by the tests:
- a scene is held out when ``(shape + colour + background + position) % 9 == 0`` on the
  indices of the word tuples: 60 of 450. Training never draws them, so the captions that
  name all four parts of a held-out scene are never trained on, while every attribute value
  and every pair of values still appears in training (the held-out scenes test composition);
- a caption that leaves a part out is held out when its canonical text (template filled with
  canonical words) is among the 1/8 of its family's canonical texts with the lowest CRC-32:
  training never uses it in any spelling, letter case or punctuation;
- training never draws a held-out scene, so a partial caption whose completion by the defaults
  is a held-out scene is not trained on either. It is not paired with another completion: that
  taught the model an exception exactly at the held-out scenes ("a black circle on red" at top
  left because the centre one is held out), which then drew "…, center" in the top left.
"""
from __future__ import annotations

import itertools
import random
import zlib
from dataclasses import dataclass
from functools import cache

import numpy as np
import torch
from PIL import Image, ImageDraw

from acceldemo.models.shapes.phrasing import (
    CANONICAL_FAMILY,
    COLOURS,
    FAMILIES,
    FAMILY_WEIGHTS,
    POSITIONS,
    SHAPES,
    Caption,
    asked_parts,
    caption,
    fill,
)

PALETTE: dict[str, tuple[int, int, int]] = dict(zip(COLOURS, (
    (220, 30, 30), (30, 170, 50), (30, 60, 220), (240, 220, 40), (245, 245, 245), (15, 15, 15),
), strict=True))
# Shape centres as fractions of the frame's (width, height).
POSITION_CENTRES: dict[str, tuple[float, float]] = dict(zip(POSITIONS, (
    (0.25, 0.25), (0.75, 0.25), (0.25, 0.75), (0.75, 0.75), (0.5, 0.5),
), strict=True))
# Pixels, the same at every size: half the side of the shape's bounding box, and the ± jitter on
# that half side and on each coordinate of the centre. A shape is 22 px across in every frame
# (a quarter of the shorter side at 64 px); only where it is scales with the frame.
HALF_SIZE = 11
SIZE_JITTER = 1
CENTRE_JITTER = 1
HELD_OUT_MODULUS = 9
HELD_OUT_TEXT_SHARE = 8  # one in this many canonical texts of a family is held out

# Drawing styles of `render`: the base model's filled shapes, and the outline a LoRA learns. The
# outline's stroke is in pixels, the same at every size like the shape (22 px across), per shape: the
# triangle's hollow is smallest (its inradius is 6.8 px against the others' 11), so its stroke is thinner;
# thinner strokes come back from the VAE in muddier colours, a thicker one fills a triangle's hollow.
STYLES = ("filled", "outline")
OUTLINE_STROKE: dict[str, float] = {"circle": 5.0, "square": 5.0, "triangle": 3.0}

_SUPERSAMPLE = 4  # draw at 4× and box-filter down, so edges are anti-aliased


@dataclass(frozen=True)
class Scene:
    """What one image shows, every part named."""

    shape: str
    colour: str
    background: str
    position: str

    @property
    def parts(self) -> dict[str, str]:
        return {"shape": self.shape, "colour": self.colour, "background": self.background, "position": self.position}

    @property
    def template_caption(self) -> str:
        """Its caption in the one template of the original model: "a red circle on a blue background, top left"."""
        return fill(FAMILIES[CANONICAL_FAMILY][0], self.parts)

    @property
    def is_held_out(self) -> bool:
        index_sum = (
            SHAPES.index(self.shape)
            + COLOURS.index(self.colour)
            + COLOURS.index(self.background)
            + POSITIONS.index(self.position)
        )
        return index_sum % HELD_OUT_MODULUS == 0


def all_scenes() -> list[Scene]:
    """Every scene, in a fixed order."""
    return [
        Scene(shape, colour, background, position)
        for shape, colour, background, position in itertools.product(SHAPES, COLOURS, COLOURS, POSITIONS)
        if colour != background
    ]


def training_scenes() -> list[Scene]:
    return [scene for scene in all_scenes() if not scene.is_held_out]


def held_out_scenes() -> list[Scene]:
    return [scene for scene in all_scenes() if scene.is_held_out]


# What the model draws for a part a caption leaves out: the first choice here that makes a
# scene (the two colours differ), whether or not that scene is held out. One fixed picture per
# caption, not a random one: a few-step sampler trained on random completions draws their
# average, a blur of every position and background at once.
DEFAULTS: dict[str, tuple[str, ...]] = {
    "position": ("center", *(position for position in POSITIONS if position != "center")),
    "background": ("black", "white", *(colour for colour in COLOURS if colour not in ("black", "white"))),
    "colour": ("white", "black", *(colour for colour in COLOURS if colour not in ("black", "white"))),
}


@cache
def _scene_drawn_for(parts: tuple[tuple[str, str], ...]) -> Scene:
    asked = dict(parts)
    fitting = [scene for scene in all_scenes() if all(scene.parts[part] == asked[part] for part in asked)]
    return min(fitting, key=lambda scene: [DEFAULTS[part].index(scene.parts[part]) for part in DEFAULTS])


def scene_drawn_for(caption_: Caption) -> Scene:
    """The scene a caption is paired with: what it asks for, completed by `DEFAULTS`."""
    return _scene_drawn_for(tuple(sorted(caption_.parts.items())))


def _asks_everything(template: str) -> bool:
    return asked_parts(template) == set(Scene.__dataclass_fields__)


@cache
def _partial_texts(family: str) -> dict[str, tuple[str, dict[str, str]]]:
    """Canonical text → (template, asked parts) of every caption of `family` that leaves a part out."""
    texts: dict[str, tuple[str, dict[str, str]]] = {}
    for template in FAMILIES[family]:
        if _asks_everything(template):
            continue
        for scene in all_scenes():
            parts = {part: scene.parts[part] for part in asked_parts(template)}
            texts.setdefault(fill(template, parts), (template, parts))
    return texts


@cache
def held_out_texts(family: str) -> frozenset[str]:
    """The canonical texts of `family`'s partial captions that training never uses."""
    texts = sorted(_partial_texts(family), key=lambda text: (zlib.crc32(text.encode()), text))
    return frozenset(texts[: -(-len(texts) // HELD_OUT_TEXT_SHARE)] if texts else ())


def is_held_out(caption_: Caption) -> bool:
    """Whether evaluation keeps this caption from training (in any spelling)."""
    if _asks_everything(caption_.template):
        return Scene(**caption_.parts).is_held_out
    return caption_.canonical_text in held_out_texts(caption_.family)


def is_trained_on(caption_: Caption) -> bool:
    """Whether training may use this caption: it is not held out, nor is the scene it is paired with."""
    return not is_held_out(caption_) and not scene_drawn_for(caption_).is_held_out


def training_caption(scene: Scene, rng: random.Random) -> Caption:
    """A caption for a training scene in a random family and phrasing that training may use."""
    families, weights = zip(*FAMILY_WEIGHTS.items())
    while True:
        drawn = caption(rng.choices(families, weights)[0], scene.parts, rng)
        if is_trained_on(drawn):
            return drawn


def held_out_captions(family: str, count: int, seed: int = 0) -> list[Caption]:
    """`count` held-out captions of `family`, spread over its held-out scenes or canonical texts."""
    rng = random.Random(f"{family}/{seed}")
    if all(_asks_everything(template) for template in FAMILIES[family]):
        scenes = held_out_scenes()
        return [caption(family, scenes[i % len(scenes)].parts, rng) for i in range(count)]
    keys = sorted(held_out_texts(family))
    captions = []
    for i in range(count):
        template, parts = _partial_texts(family)[keys[i % len(keys)]]
        captions.append(caption(family, parts, rng, template))
    return captions


def render(
    scene: Scene, width: int = 64, height: int = 64, seed: int | None = None, style: str = "filled"
) -> Image.Image:
    """Draw a scene at width×height; seed=None draws it without jitter (exact size and centre).

    style "filled" (the default) fills the shape with its colour; "outline" draws only a stroke
    `OUTLINE_STROKE[shape]` pixels wide along the same outer edge, the background showing inside (the
    shape minus the same shape inset by the stroke: a uniform stroke, the triangle's inset about its
    incentre). The same seed jitters both styles alike.
    """
    if style not in STYLES:
        raise ValueError(f"unknown style {style!r}; known styles: {', '.join(STYLES)}")
    centre_x, centre_y = POSITION_CENTRES[scene.position]
    centre_x, centre_y, half = centre_x * width, centre_y * height, HALF_SIZE
    if seed is not None:
        rng = np.random.default_rng(seed)
        dx, dy = rng.uniform(-CENTRE_JITTER, CENTRE_JITTER, size=2)
        centre_x, centre_y = centre_x + dx, centre_y + dy
        half += rng.uniform(-SIZE_JITTER, SIZE_JITTER)

    s = _SUPERSAMPLE
    canvas = Image.new("RGB", (width * s, height * s), PALETTE[scene.background])
    draw = ImageDraw.Draw(canvas)
    left, top, right, bottom = (
        (centre_x - half) * s,
        (centre_y - half) * s,
        (centre_x + half) * s,
        (centre_y + half) * s,
    )
    fill_colour = PALETTE[scene.colour]
    _draw_shape(draw, scene.shape, centre_x * s, (left, top, right, bottom), fill_colour)
    if style == "outline":
        _draw_shape(draw, scene.shape, centre_x * s, (left, top, right, bottom), PALETTE[scene.background],
                    inset=OUTLINE_STROKE[scene.shape] * s)
    return canvas.resize((width, height), Image.Resampling.BOX)


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, apex_x: float, box: tuple[float, float, float, float],
                colour: tuple[int, int, int], inset: float = 0.0) -> None:
    """Fill `shape` in `box` (the triangle's apex at apex_x, top), shrunk so each edge moves `inset` inwards."""
    left, top, right, bottom = box
    if shape == "circle":
        draw.ellipse((left + inset, top + inset, right - inset, bottom - inset), fill=colour)
    elif shape == "square":
        draw.rectangle((left + inset, top + inset, right - inset, bottom - inset), fill=colour)
    elif shape == "triangle":
        corners = np.array([(apex_x, top), (right, bottom), (left, bottom)], dtype=np.float64)
        if inset:
            # Scale about the incentre by (r - inset) / r: every edge moves `inset` inwards.
            sides = np.array([np.linalg.norm(corners[(i + 1) % 3] - corners[(i + 2) % 3]) for i in range(3)])
            incentre = (sides[:, None] * corners).sum(axis=0) / sides.sum()
            area = abs(np.cross(corners[1] - corners[0], corners[2] - corners[0])) / 2
            inradius = 2 * area / sides.sum()
            corners = incentre + (corners - incentre) * max(0.0, inradius - inset) / inradius
        draw.polygon([tuple(corner) for corner in corners], fill=colour)
    else:
        raise ValueError(f"unknown shape {shape!r}; known shapes: {', '.join(SHAPES)}")


def images_as_tensor(images: list[Image.Image]) -> torch.Tensor:
    """Stack PIL images into a float tensor in [-1, 1], shaped (N, 3, H, W), as the VAE expects."""
    array = np.stack([np.asarray(image, dtype=np.float32) for image in images])
    return torch.from_numpy(array).permute(0, 3, 1, 2) / 127.5 - 1.0
