"""A pixel-statistics judge that reads a shapes image of any size back into a scene, to score generated images.

How it reads an RGB image:
1. background = the palette colour nearest to the median of the outermost ring of pixels;
2. shape colour = the palette colour (other than the background) nearest to the mean of the
   pixels that lie more than ``FAR_FROM_BACKGROUND`` (RGB distance) from the background colour;
3. shape mask = pixels closer to the shape colour than to the background colour, keeping the
   largest 4-connected blob (stray specks elsewhere do not move it);
4. position = the named position whose centre is nearest the mask's centroid, both as fractions
   of the frame's width and height (so 64×64, 128×128, 128×64 and 64×128 read alike);
5. shape = from two measures of the mask in its bounding box. The centroid's drop below the
   box centre, as a fraction of the box height, is 1/6 for an upright triangle and 0 for a
   circle or a square: above 1/12 reads as a triangle. Otherwise the fill ratio of the box
   tells the square (≈ 1) from the circle (π/4 ≈ 0.785), cut halfway. The drop survives
   blurred corners, which push a triangle's fill ratio from 0.5 towards a circle's.
A colour (the ring's median; the median of the mask) farther than ``COLOUR_TOLERANCE`` from the
palette colour it was read as is no palette colour: that field is None, so a muddy background or
a smudge fails even where the caption leaves the colour free. An image with no pixel far from the
background reads as no shape (every field but the background is None). A caption that leaves a
part out accepts any value the judge reads there.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
from PIL import Image

from acceldemo.models.shapes.phrasing import Caption

from .dataset import PALETTE, POSITION_CENTRES, Scene

FAR_FROM_BACKGROUND = 80.0  # about half the smallest distance between two palette colours
COLOUR_TOLERANCE = 80.0
TRIANGLE_DROP_CUT = 1 / 12
CIRCLE_SQUARE_CUT = (np.pi / 4 + 1.0) / 2

_PALETTE_NAMES = list(PALETTE)
_PALETTE_RGB = np.array([PALETTE[name] for name in _PALETTE_NAMES], dtype=np.float32)


@dataclass(frozen=True)
class Judgement:
    """What the judge read from one image; None where it could not tell."""

    background: str | None
    colour: str | None
    position: str | None
    shape: str | None
    fill_ratio: float | None
    centroid_drop: float | None

    def matches(self, asked: Scene | Caption) -> dict[str, bool]:
        """Which parts the image got right; 'colours' needs both colours. A part that `asked` leaves
        out (None) is right whenever the image shows one: a shape must be there in any case.
        """
        def right(judged: str | None, wanted: str | None) -> bool:
            return judged is not None and (wanted is None or judged == wanted)

        colour, background = right(self.colour, asked.colour), right(self.background, asked.background)
        return {
            "colour": colour,
            "background": background,
            "colours": colour and background,
            "position": right(self.position, asked.position),
            "shape": right(self.shape, asked.shape),
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


def _within_tolerance(rgb: np.ndarray, name: str) -> str | None:
    return name if np.linalg.norm(rgb - np.array(PALETTE[name], dtype=np.float32)) <= COLOUR_TOLERANCE else None


def judge(image: Image.Image) -> Judgement:
    pixels = np.asarray(image.convert("RGB"), dtype=np.float32)
    ring = np.concatenate([pixels[0], pixels[-1], pixels[1:-1, 0], pixels[1:-1, -1]])
    ring_median = np.median(ring, axis=0)
    background = _nearest_palette_colour(ring_median)
    background_rgb = np.array(PALETTE[background], dtype=np.float32)
    read_background = _within_tolerance(ring_median, background)

    far = np.linalg.norm(pixels - background_rgb, axis=2) > FAR_FROM_BACKGROUND
    if not far.any():
        return Judgement(
            background=read_background, colour=None, position=None, shape=None, fill_ratio=None, centroid_drop=None
        )
    colour = _nearest_palette_colour(pixels[far].mean(axis=0), exclude=background)
    colour_rgb = np.array(PALETTE[colour], dtype=np.float32)

    closer_to_shape = np.linalg.norm(pixels - colour_rgb, axis=2) < np.linalg.norm(pixels - background_rgb, axis=2)
    mask = _largest_blob(closer_to_shape)
    ys, xs = np.nonzero(mask)
    height, width = mask.shape
    centroid = np.array([(xs.mean() + 0.5) / width, (ys.mean() + 0.5) / height])
    position = min(POSITION_CENTRES, key=lambda name: np.linalg.norm(centroid - np.array(POSITION_CENTRES[name])))
    box_height = ys.max() - ys.min() + 1
    box_area = (xs.max() - xs.min() + 1) * box_height
    fill_ratio = float(mask.sum() / box_area)
    centroid_drop = float((ys.mean() - (ys.min() + ys.max()) / 2) / box_height)
    return Judgement(
        background=read_background,
        colour=_within_tolerance(np.median(pixels[mask], axis=0), colour),
        position=position,
        shape=_shape_from_geometry(fill_ratio, centroid_drop),
        fill_ratio=fill_ratio,
        centroid_drop=centroid_drop,
    )


# The outline check. The inner box is centred on the centroid of the shape's blob with its holes filled
# (for a closed outline that is the whole shape, whose centroid lies inside a triangle's hollow too), a
# side INNER_BOX_SHARE of the blob's shorter bounding-box side: inside a filled shape it is all shape
# colour; inside a 4-pixel outline of a 22-pixel shape it is mostly background.
INNER_BOX_SHARE = 0.3
OUTLINE_CUT = 0.5  # an inner box more than half background reads as an outline


def _fill_holes(mask: np.ndarray) -> np.ndarray:
    """`mask` plus every pixel not 4-connected to the frame's border through pixels outside it."""
    height, width = mask.shape
    outside = np.zeros_like(mask)
    queue = deque((y, x) for y in range(height) for x in (0, width - 1) if not mask[y, x])
    queue.extend((y, x) for x in range(width) for y in (0, height - 1) if not mask[y, x])
    for start in queue:
        outside[start] = True
    while queue:
        y, x = queue.popleft()
        for ny, nx in ((y - 1, x), (y + 1, x), (y, x - 1), (y, x + 1)):
            if 0 <= ny < height and 0 <= nx < width and not mask[ny, nx] and not outside[ny, nx]:
                outside[ny, nx] = True
                queue.append((ny, nx))
    return ~outside


def hollowness(image: Image.Image) -> float | None:
    """The share of the shape's inner box closer to the background colour than to the shape colour:
    about 0 for a filled shape, most of the box for an outline; None where no shape is read.

    Colours are read as `judge` reads them (background from the outer ring, shape colour from the
    pixels far from it); the shape is the largest blob of pixels closer to the shape colour. The
    inner box: `INNER_BOX_SHARE` of the blob's shorter bounding-box side, centred on the centroid
    of the blob with its holes filled.
    """
    pixels = np.asarray(image.convert("RGB"), dtype=np.float32)
    ring = np.concatenate([pixels[0], pixels[-1], pixels[1:-1, 0], pixels[1:-1, -1]])
    background = _nearest_palette_colour(np.median(ring, axis=0))
    background_rgb = np.array(PALETTE[background], dtype=np.float32)
    far = np.linalg.norm(pixels - background_rgb, axis=2) > FAR_FROM_BACKGROUND
    if not far.any():
        return None
    colour_rgb = np.array(PALETTE[_nearest_palette_colour(pixels[far].mean(axis=0), exclude=background)],
                          dtype=np.float32)
    closer_to_shape = np.linalg.norm(pixels - colour_rgb, axis=2) < np.linalg.norm(pixels - background_rgb, axis=2)
    blob = _largest_blob(closer_to_shape)
    ys, xs = np.nonzero(blob)
    side = min(xs.max() - xs.min() + 1, ys.max() - ys.min() + 1)
    half = max(1.0, INNER_BOX_SHARE * side / 2)
    filled_ys, filled_xs = np.nonzero(_fill_holes(blob))
    centre_x, centre_y = filled_xs.mean() + 0.5, filled_ys.mean() + 0.5
    # Pixels whose centres fall in the box (at least the one under the centre).
    x0, x1 = int(np.floor(centre_x - half + 0.5)), int(np.ceil(centre_x + half - 0.5))
    y0, y1 = int(np.floor(centre_y - half + 0.5)), int(np.ceil(centre_y + half - 0.5))
    inner = closer_to_shape[max(0, y0) : max(y1, y0 + 1), max(0, x0) : max(x1, x0 + 1)]
    return float(1.0 - inner.mean())


def is_outline(image: Image.Image) -> bool:
    """Whether the shape is drawn as an outline (its inner box mostly background), not filled."""
    measure = hollowness(image)
    return measure is not None and measure > OUTLINE_CUT
