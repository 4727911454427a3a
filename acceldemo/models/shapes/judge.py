"""A pixel-statistics judge that reads a shapes image back into a scene, to score generated images.

How it reads a 64×64 RGB image:
1. background = the palette colour nearest to the median of the outermost ring of pixels;
2. shape colour = the palette colour (other than the background) nearest to the mean of the
   pixels that lie more than ``FAR_FROM_BACKGROUND`` (RGB distance) from the background colour;
3. shape mask = pixels closer to the shape colour than to the background colour, keeping the
   largest 4-connected blob (stray specks elsewhere do not move it);
4. position = the named position whose centre is nearest the mask's centroid;
5. shape = from two measures of the mask in its bounding box. The centroid's drop below the
   box centre, as a fraction of the box height, is 1/6 for an upright triangle and 0 for a
   circle or a square: above 1/12 reads as a triangle. Otherwise the fill ratio of the box
   tells the square (≈ 1) from the circle (π/4 ≈ 0.785), cut halfway. The drop survives
   blurred corners, which push a triangle's fill ratio from 0.5 towards a circle's.
An image with no pixel far from the background reads as no shape (every field but the
background is None).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
from PIL import Image

from .dataset import PALETTE, POSITIONS, Scene

FAR_FROM_BACKGROUND = 80.0  # about half the smallest distance between two palette colours
TRIANGLE_DROP_CUT = 1 / 12
CIRCLE_SQUARE_CUT = (np.pi / 4 + 1.0) / 2

_PALETTE_NAMES = list(PALETTE)
_PALETTE_RGB = np.array([PALETTE[name] for name in _PALETTE_NAMES], dtype=np.float32)


@dataclass(frozen=True)
class Judgement:
    """What the judge read from one image; None where it could not tell."""

    background: str
    colour: str | None
    position: str | None
    shape: str | None
    fill_ratio: float | None
    centroid_drop: float | None

    def matches(self, scene: Scene) -> dict[str, bool]:
        """Which parts of a scene the image got right; 'colours' needs both colours."""
        return {
            "colour": self.colour == scene.colour,
            "background": self.background == scene.background,
            "colours": self.colour == scene.colour and self.background == scene.background,
            "position": self.position == scene.position,
            "shape": self.shape == scene.shape,
        }


def _nearest_palette_colour(rgb: np.ndarray, exclude: str | None = None) -> str:
    distances = np.linalg.norm(_PALETTE_RGB - rgb, axis=1)
    if exclude is not None:
        distances[_PALETTE_NAMES.index(exclude)] = np.inf
    return _PALETTE_NAMES[int(np.argmin(distances))]


def _largest_blob(mask: np.ndarray) -> np.ndarray:
    labels = np.zeros(mask.shape, dtype=np.int32)
    height, width = mask.shape
    best_label, best_size, next_label = 0, 0, 1
    for start in zip(*np.nonzero(mask)):
        if labels[start]:
            continue
        labels[start] = next_label
        queue, size = deque([start]), 0
        while queue:
            y, x = queue.popleft()
            size += 1
            for ny, nx in ((y - 1, x), (y + 1, x), (y, x - 1), (y, x + 1)):
                if 0 <= ny < height and 0 <= nx < width and mask[ny, nx] and not labels[ny, nx]:
                    labels[ny, nx] = next_label
                    queue.append((ny, nx))
        if size > best_size:
            best_label, best_size = next_label, size
        next_label += 1
    return labels == best_label


def _shape_from_geometry(fill_ratio: float, centroid_drop: float) -> str:
    if centroid_drop > TRIANGLE_DROP_CUT:
        return "triangle"
    if fill_ratio < CIRCLE_SQUARE_CUT:
        return "circle"
    return "square"


def judge(image: Image.Image) -> Judgement:
    pixels = np.asarray(image.convert("RGB"), dtype=np.float32)
    ring = np.concatenate([pixels[0], pixels[-1], pixels[1:-1, 0], pixels[1:-1, -1]])
    background = _nearest_palette_colour(np.median(ring, axis=0))
    background_rgb = np.array(PALETTE[background], dtype=np.float32)

    far = np.linalg.norm(pixels - background_rgb, axis=2) > FAR_FROM_BACKGROUND
    if not far.any():
        return Judgement(
            background=background, colour=None, position=None, shape=None, fill_ratio=None, centroid_drop=None
        )
    colour = _nearest_palette_colour(pixels[far].mean(axis=0), exclude=background)
    colour_rgb = np.array(PALETTE[colour], dtype=np.float32)

    closer_to_shape = np.linalg.norm(pixels - colour_rgb, axis=2) < np.linalg.norm(pixels - background_rgb, axis=2)
    mask = _largest_blob(closer_to_shape)
    ys, xs = np.nonzero(mask)
    centroid = np.array([xs.mean(), ys.mean()])
    position = min(POSITIONS, key=lambda name: np.linalg.norm(centroid - np.array(POSITIONS[name])))
    box_height = ys.max() - ys.min() + 1
    box_area = (xs.max() - xs.min() + 1) * box_height
    fill_ratio = float(mask.sum() / box_area)
    centroid_drop = float((ys.mean() - (ys.min() + ys.max()) / 2) / box_height)
    return Judgement(
        background=background,
        colour=colour,
        position=position,
        shape=_shape_from_geometry(fill_ratio, centroid_drop),
        fill_ratio=fill_ratio,
        centroid_drop=centroid_drop,
    )
