"""A pipeline as an executor holds it: the diffusers pipeline, and everything this product adds to it in one object
of ours — the model it is, its weights' size, its LoRA style slot, the step caches' call seam, the preview map and
the edit pipelines made from it. Nothing of ours is set on the diffusers objects; what changes them goes through
their own APIs (`load_lora_weights`, `enable_cache`, `compile`, `from_pipe`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..models.catalog import ModelSpec
from ..models.latent_rgb import LatentRGB
from ..records import EditMethod
from .step_cache import CallSeam
from .styles import StyleSlot


@dataclass(eq=False)
class PreparedPipeline:
    """The pipeline placed and compiled per its recipe (`recipe.apply_recipe` makes it), and its companions."""

    pipe: Any
    spec: ModelSpec
    weight_bytes: int = 0
    styles: StyleSlot | None = None
    latent_rgb: LatentRGB | None = None
    # Diffusers' image-to-image and inpainting pipelines made from this one (`from_pipe`: the same modules).
    edit_pipes: dict[EditMethod, Any] = field(default_factory=dict)
    _seam: CallSeam | None = None

    def seam(self) -> CallSeam:
        """The transformer's call seam, made at the first ask: after the recipe's compile, so it wraps the compiled
        call."""
        if self._seam is None:
            self._seam = CallSeam(self.pipe.transformer)
        return self._seam
