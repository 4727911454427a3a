"""A deeper tiny FLUX.2-klein: the embedded model with more repeated blocks, where regional compile pays off."""
from __future__ import annotations

DEEP_DOUBLE_BLOCKS = 8
DEEP_SINGLE_BLOCKS = 8


def build_deep_flux2_klein(double_blocks: int = DEEP_DOUBLE_BLOCKS, single_blocks: int = DEEP_SINGLE_BLOCKS):
    """The tiny flux2-klein pipeline whose transformer has `double_blocks` + `single_blocks` blocks.

    Built from the embedded model's own transformer config, so everything but the depth is the tiny model's;
    weights are random and deterministic like the tiny model's.
    """
    import torch
    from diffusers import Flux2Transformer2DModel

    from ..models.tiny import build_tiny_pipeline

    pipe = build_tiny_pipeline("flux2-klein")
    config = {**pipe.transformer.config, "num_layers": double_blocks, "num_single_layers": single_blocks}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        pipe.transformer = Flux2Transformer2DModel.from_config(config).eval()
    pipe.set_progress_bar_config(disable=True)
    return pipe
