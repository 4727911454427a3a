"""Step caches (a transformer's work reused across denoise steps, diffusers' cache hooks) and quantized weights: what
each technique is, which families it works on, and the presets a model states with the reason for each."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..records import Quantization, StepCache
from .families import PipelineFamily

NONE = "none"
AUTO = "auto"


# What a request may ask for: no cache, the model's recommendation, or a cache by name.
STEP_CACHE_CHOICES = (NONE, AUTO, *(str(cache) for cache in StepCache))


@dataclass(frozen=True)
class Technique:
    """One step cache: diffusers' config class, where it hooks, the paper or project it comes from.

    seam "call": it decides before the transformer runs whether to run it at all, from the step count alone, and
    answers a skipped call from its own state (TaylorSeer's Taylor series of the transformer's output). It works
    around any transformer — eager, compiled whole or per block, an AOTInductor package, tensor-parallel ranks
    (which all skip the same steps). seam "blocks": diffusers' hooks on the transformer's blocks or attention layers
    decide inside the transformer, in Python (`torch.compiler.disable`, data-dependent branches); a `fullgraph=True`
    compile cannot trace them, so they run in eager modes only.
    """

    title: str
    config_class: str
    seam: str
    source: str


TECHNIQUES: dict[StepCache, Technique] = {
    StepCache.TAYLORSEER: Technique(
        "TaylorSeer", "TaylorSeerCacheConfig", "call",
        "Liu et al. 2025, 'From Reusing to Forecasting' (arXiv 2503.06923): a skipped step's output forecast by a "
        "Taylor series of the last computed ones; here of the transformer's whole output, diffusers' own "
        "TaylorSeerCacheHook schedule and state at the transformer's call"),
    StepCache.FIRST_BLOCK: Technique(
        "First Block Cache", "FirstBlockCacheConfig", "blocks",
        "ParaAttention's dynamic caching: when the first block's residual changes less than a threshold, the other "
        "blocks' residual is reused"),
    StepCache.MAG: Technique(
        "MagCache", "MagCacheConfig", "blocks",
        "Ma et al. 2025, 'Magnitude-aware Cache' (arXiv 2506.09045): skips steps while the calibrated magnitude "
        "ratios say the residual barely moves"),
    StepCache.PAB: Technique(
        "Pyramid Attention Broadcast", "PyramidAttentionBroadcastConfig", "blocks",
        "Zhao et al. 2024 (arXiv 2408.12588): attention outputs reused over a range of middle timesteps"),
    StepCache.FASTER: Technique(
        "FasterCache", "FasterCacheConfig", "blocks",
        "Lv et al. 2024 (arXiv 2410.19355): attention and CFG outputs approximated from earlier steps, for video"),
    StepCache.SEA: Technique(
        "SeaCache", "SeaCacheConfig", "blocks",
        "Spectral-evolution-aware cache (arXiv 2602.18993), for video transformers"),
}

# Why a cache cannot work on a pipeline family here, whatever the model's presets say (diffusers 0.42.1, checked on
# the embedded tiny model of each family: `tests/test_step_cache.py`).
_NOT_ON_SD3 = ("diffusers 0.42.1's SD3Transformer2DModel has no enable_cache (it is not a CacheMixin), so its block "
               "hooks cannot be applied to it")
FAMILY_REFUSALS: dict[tuple[PipelineFamily, StepCache], str] = {
    **{(PipelineFamily.SD3, cache): _NOT_ON_SD3 for cache in StepCache if not cache.decides_per_call},
    (PipelineFamily.FLUX2_KLEIN, StepCache.FIRST_BLOCK): "diffusers 0.42.1's FirstBlockCache fails on FLUX.2 klein's "
                                                   "transformer (TypeError: tensor minus list, in the first block's "
                                                   "residual)",
    (PipelineFamily.FLUX2, StepCache.FIRST_BLOCK): "diffusers 0.42.1's Flux2Pipeline sets no cache context, which "
                                              "FirstBlockCache needs (ValueError at the first step)",
    **{(family, StepCache.FASTER): "diffusers 0.42.1's FasterCache fails on FLUX's joint attention (TypeError at its "
                                   "first approximated step): it is written for video transformers"
       for family in (PipelineFamily.FLUX1, PipelineFamily.FLUX2_KLEIN, PipelineFamily.FLUX2)},
    **{(family, StepCache.SEA): "diffusers 0.42.1's SeaCache has adapters for video transformers (Cosmos) only: on an "
                                "image transformer it runs fail-open, computing every step, and buys nothing"
       for family in (PipelineFamily.FLUX1, PipelineFamily.FLUX2_KLEIN, PipelineFamily.FLUX2)},
}


@dataclass(frozen=True)
class CachePreset:
    """One cache as a model offers it: the diffusers config's fields and why these values."""

    cache: StepCache
    params: dict = field(default_factory=dict)
    why: str = ""

    def describe(self) -> dict:
        return {"name": str(self.cache), "title": TECHNIQUES[self.cache].title, "params": dict(self.params),
                "why": self.why}


@dataclass(frozen=True)
class CacheAdvice:
    """What `auto` means for a model: its recommended cache from this many steps on (below, none), and why."""

    cache: StepCache | None
    from_steps: int = 1
    why: str = ""

    def resolve(self, steps: int) -> StepCache | None:
        return self.cache if self.cache is not None and steps >= self.from_steps else None

    def describe(self) -> dict:
        return {"cache": str(self.cache) if self.cache else NONE, "from_steps": self.from_steps, "why": self.why}


# --- presets shared by families ------------------------------------------------------------------------------

def taylorseer(interval: int, before: int, why: str, factors: str = "float32") -> CachePreset:
    return CachePreset(StepCache.TAYLORSEER, {"cache_interval": interval, "disable_cache_before_step": before,
                                              "max_order": 1, "taylor_factors_dtype": factors}, why)


PAB_FLUX = CachePreset(
    StepCache.PAB, {"spatial_attention_block_skip_range": 2, "spatial_attention_timestep_skip_range": (100, 800)},
    "diffusers' documented setting: every other step's attention reused between timesteps 100 and 800 (the middle of "
    "the schedule, where attention changes least)")
FIRST_BLOCK_FLUX1 = CachePreset(
    StepCache.FIRST_BLOCK, {"threshold": 0.08},
    "ParaAttention's FLUX.1-dev setting (residual_diff_threshold=0.08)")
MAG_FLUX1 = CachePreset(
    StepCache.MAG, {"mag_ratios": "FLUX_MAG_RATIOS"},
    "diffusers' FLUX_MAG_RATIOS (calibrated on FLUX.1-dev, interpolated to the request's steps)")


# --- quantized weights -----------------------------------------------------------------------------------------

# Components torchao quantizes (their Linear layers): the transformer and every text encoder. The VAE stays in the
# model's dtype (mostly convolutions, a small share of the bytes, and where rounding shows first).
QUANTIZED_PREFIXES = ("transformer", "text_encoder")

# What each quantization is expected to cost in quality on the real models, from the peers' published figures.
QUANTIZATION_QUALITY: dict[Quantization, str] = {
    Quantization.INT8: "weight-only int8 halves the bf16 weights (a byte per weight instead of two); the serving peers "
                       "and torchao's diffusers benchmarks report images close to bf16's at 1.3-1.8x on H100 (the "
                       "figure issue 39 cites); measured here on tiny-shapes: the judge's scene accuracy unchanged "
                       "(bench section acceleration)",
    Quantization.FP8: "fp8 (e4m3) weights halve the bf16 weights as int8 does, with fp8 matmuls where the hardware "
                      "has them; the same peers report 1.3-1.8x on H100 with small detail changes; not measurable "
                      "on this CPU-only host",
}
