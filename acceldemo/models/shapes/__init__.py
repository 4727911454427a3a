"""The embedded shapes model: a tiny FLUX.2-klein pipeline trained here to draw captioned shapes."""
from __future__ import annotations

from pathlib import Path

_WEIGHTS = Path(__file__).resolve().parent / "weights"

# (width, height) it was trained and evaluated at, the default first: the only sizes it is served at. At any other
# size it draws fragments (MODEL_CARD.md, Limitations).
SIZES: tuple[tuple[int, int], ...] = ((64, 64),)

# FLUX.2-klein is step-distilled: the pipeline ignores guidance_scale (is_distilled=True).
RECOMMENDED_STEPS = 4


def trained_model_dir() -> Path:
    """The committed pipeline folder, loadable with `Flux2KleinPipeline.from_pretrained`."""
    return _WEIGHTS
