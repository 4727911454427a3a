"""The diffusers pipeline families this product runs: what edits, step caches and previews dispatch on, named once
(never by a loaded object's class name)."""
from __future__ import annotations

from enum import StrEnum


class PipelineFamily(StrEnum):
    """A text-to-image pipeline of diffusers, by its class name (what its model_index.json names)."""

    FLUX1 = "FluxPipeline"
    FLUX2 = "Flux2Pipeline"
    FLUX2_KLEIN = "Flux2KleinPipeline"
    SD3 = "StableDiffusion3Pipeline"

    @property
    def flux2(self) -> bool:
        """FLUX.2 and FLUX.2-klein: latents packed 2x2 with position ids, batch-normalised; no image-to-image
        pipeline of their own in diffusers."""
        return self in (PipelineFamily.FLUX2, PipelineFamily.FLUX2_KLEIN)

    def pipeline_class(self):
        """The diffusers class itself (imports diffusers)."""
        import diffusers

        return getattr(diffusers, self.value)
