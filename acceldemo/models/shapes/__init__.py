"""The embedded shapes model: a tiny FLUX.2-klein pipeline trained here to draw captioned shapes."""
from __future__ import annotations

from pathlib import Path

_WEIGHTS = Path(__file__).resolve().parent / "weights"

# (width, height) it was trained and evaluated at; positions are relative to the frame, the shape is
# 22 px across at every size, and each size is its own static shape for compiled modes.
TRAINED_SIZES: tuple[tuple[int, int], ...] = ((64, 64), (128, 128), (128, 64), (64, 128))
# The sizes it is served at, the default first: those where it draws shapes right (MODEL_CARD.md, Evaluation):
# every size it was trained at.
SIZES: tuple[tuple[int, int], ...] = TRAINED_SIZES

# FLUX.2-klein is step-distilled: the pipeline ignores guidance_scale (is_distilled=True).
RECOMMENDED_STEPS = 4
# Training cut text to the prompt plus up to 31 pads (every 16th batch 512): at the pipeline's default of 512 the
# conditioning is hundreds of identical pad tokens and shapes suffer (MODEL_CARD.md, Recommended settings).
RECOMMENDED_MAX_SEQUENCE_LENGTH = 64


def trained_model_dir() -> Path:
    """The committed pipeline folder, loadable with `Flux2KleinPipeline.from_pretrained`."""
    return _WEIGHTS
