"""The synthetic shapes dataset: one flat shape on a flat background, drawn by code, with its caption.

A scene is shape × shape colour × background colour × position (the two colours differ):
3 × 6 × 5 × 5 = 450 captions such as "a red circle on a blue background, top left".
Each drawing jitters the size and the centre a little, from a seeded generator, so the
same (scene, seed) always gives the same 64×64 RGB image.

Held-out split: a scene is held out for evaluation when
``(shape + colour + background + position) % 9 == 0`` on the indices of the tuples
below, which holds back 60 of the 450 captions. Every single attribute value and every
pair of attribute values of a held-out scene still appears in some training scene, so
the held-out captions test composition, not unseen words.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, ImageDraw

from .phrasing import COLOURS, SHAPES, TEMPLATE
from .phrasing import POSITIONS as POSITION_NAMES

IMAGE_SIZE = 64

PALETTE: dict[str, tuple[int, int, int]] = dict(zip(COLOURS, (
    (220, 30, 30), (30, 170, 50), (30, 60, 220), (240, 220, 40), (245, 245, 245), (15, 15, 15),
), strict=True))
# Shape centres in pixels of the 64×64 image, as (x, y).
POSITIONS: dict[str, tuple[float, float]] = dict(zip(POSITION_NAMES, (
    (16.0, 16.0), (48.0, 16.0), (16.0, 48.0), (48.0, 48.0), (32.0, 32.0),
), strict=True))
HALF_SIZE = 11.0  # half the side of the shape's bounding box, in pixels
SIZE_JITTER = 1.0  # ± pixels on the half size
CENTRE_JITTER = 1.0  # ± pixels on each coordinate of the centre
HELD_OUT_MODULUS = 9

_SUPERSAMPLE = 4  # draw at 4× and box-filter down, so edges are anti-aliased


@dataclass(frozen=True)
class Scene:
    """What one image shows; the caption is derived from it."""

    shape: str
    colour: str
    background: str
    position: str

    @property
    def caption(self) -> str:
        return TEMPLATE.format(colour=self.colour, shape=self.shape, background=self.background, position=self.position)

    @property
    def is_held_out(self) -> bool:
        index_sum = (
            SHAPES.index(self.shape)
            + COLOURS.index(self.colour)
            + COLOURS.index(self.background)
            + list(POSITIONS).index(self.position)
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


def render(scene: Scene, seed: int | None = None) -> Image.Image:
    """Draw a scene; seed=None draws it without jitter (exact size and centre)."""
    centre_x, centre_y = POSITIONS[scene.position]
    half = HALF_SIZE
    if seed is not None:
        rng = np.random.default_rng(seed)
        dx, dy = rng.uniform(-CENTRE_JITTER, CENTRE_JITTER, size=2)
        centre_x, centre_y = centre_x + dx, centre_y + dy
        half += rng.uniform(-SIZE_JITTER, SIZE_JITTER)

    s = _SUPERSAMPLE
    canvas = Image.new("RGB", (IMAGE_SIZE * s, IMAGE_SIZE * s), PALETTE[scene.background])
    draw = ImageDraw.Draw(canvas)
    left, top, right, bottom = (
        (centre_x - half) * s,
        (centre_y - half) * s,
        (centre_x + half) * s,
        (centre_y + half) * s,
    )
    fill = PALETTE[scene.colour]
    if scene.shape == "circle":
        draw.ellipse((left, top, right, bottom), fill=fill)
    elif scene.shape == "square":
        draw.rectangle((left, top, right, bottom), fill=fill)
    elif scene.shape == "triangle":
        draw.polygon([(centre_x * s, top), (right, bottom), (left, bottom)], fill=fill)
    else:
        raise ValueError(f"unknown shape {scene.shape!r}; known shapes: {', '.join(SHAPES)}")
    return canvas.resize((IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.BOX)


def images_as_tensor(images: list[Image.Image]) -> torch.Tensor:
    """Stack PIL images into a float tensor in [-1, 1], shaped (N, 3, H, W), as the VAE expects."""
    array = np.stack([np.asarray(image, dtype=np.float32) for image in images])
    return torch.from_numpy(array).permute(0, 3, 1, 2) / 127.5 - 1.0
