"""The embedded shapes model: a tiny FLUX.2-klein pipeline trained here to draw captioned shapes."""
from __future__ import annotations

from pathlib import Path

_WEIGHTS = Path(__file__).resolve().parent / "weights"

# (width, height) it was trained and evaluated at; positions and the shape's size are relative to
# the frame, and each size is its own static shape for compiled modes. The first is the default.
SIZES: tuple[tuple[int, int], ...] = ((64, 64), (128, 128), (128, 64), (64, 128))

# FLUX.2-klein is step-distilled: the pipeline ignores guidance_scale (is_distilled=True).
RECOMMENDED_STEPS = 4


def trained_model_dir() -> Path:
    """The committed pipeline folder, loadable with `Flux2KleinPipeline.from_pretrained`."""
    return _WEIGHTS
