"""Previews during denoising: after a step, the latents through the model's linear latent→RGB map into a small RGB
picture of the image so far — as often as keeps their cost within a small share of the call."""
from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from ..models.latent_rgb import map_for, unpack
from ..records import Preview, Request

if TYPE_CHECKING:
    from .prepared import PreparedPipeline

# The share of the call's time previews may take: a preview is skipped while those made so far took more.
BUDGET = 0.04


class PreviewMaker:
    """Makes the previews of one call: `at_step(step, latents, elapsed)` gives a preview, or None when one now would
    take previews past BUDGET of the `elapsed` seconds since the call began (a model whose steps take little beside a
    slow device-to-host copy gets one every few steps; the tiny models and real ones, every step)."""

    def __init__(self, prepared: PreparedPipeline, request: Request, cache_dir: Path):
        import torch
        from diffusers import FlowMatchEulerDiscreteScheduler

        self.pipe, self.spec, self.request = prepared.pipe, prepared.spec, request
        if prepared.latent_rgb is None:  # looked up once per pipeline (a VAE's fingerprint reads its weights)
            prepared.latent_rgb = map_for(prepared.spec, prepared.pipe.vae, cache_dir)
        mapping = prepared.latent_rgb
        self.weights = torch.tensor(mapping.weights, dtype=torch.float32)  # (3, 2C): the channels, their squares
        self.bias = torch.tensor(mapping.bias, dtype=torch.float32).view(3, 1, 1)
        self.spent = 0.0
        self.made = 0
        # The latents of the step before, while previews follow each other (a skipped step forgets them).
        self.previous = None
        # The call's noise levels, once its scheduler has set them (at its first step).
        self.flow = isinstance(self.pipe.scheduler, FlowMatchEulerDiscreteScheduler)
        self.sigmas: list[float] | None = None

    def _denoised(self, step: int, latents):
        """What the model predicts the finished latents to be, where the scheduler tells: a flow-matching Euler step
        moves along the predicted velocity v, x(σ') = x(σ) + (σ' − σ)·v, and the finished latents are x(σ') − σ'·v —
        a picture rather than the noise still mixed into the latents (ComfyUI previews this prediction too). Without
        the step before, or with another scheduler: the latents as they are."""
        # A reference, not a copy: a scheduler step makes new latents rather than changing these in place.
        before, self.previous = self.previous, latents.detach()
        if self.flow and self.sigmas is None:
            self.sigmas = self.pipe.scheduler.sigmas.detach().cpu().double().tolist()
        if not self.flow or before is None or step >= len(self.sigmas):
            return latents
        sigma, sigma_next = self.sigmas[step - 1], self.sigmas[step]
        if sigma == sigma_next:
            return latents
        velocity = (latents - before) / (sigma_next - sigma)
        return latents - sigma_next * velocity

    def at_step(self, step: int, latents, elapsed: float) -> Preview | None:
        """The preview after denoise step `step` (1-based) of `latents`, the pipeline's own (packed) latents."""
        now = time.perf_counter()
        if self.made and self.spent > BUDGET * elapsed:
            self.previous = None
            return None
        import torch

        with torch.no_grad():
            # The first image of the batch (a request of several images runs one call per image).
            latents = latents[:1]
            shown = self._denoised(step, latents)
            raw = unpack(self.pipe, self.spec, shown, self.request.height, self.request.width)[0]
            raw = raw.to("cpu", torch.float32)
            rgb = torch.einsum("rc,chw->rhw", self.weights, torch.cat([raw, raw * raw])) + self.bias
            pixels = ((rgb.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0).numpy()
        self.spent += time.perf_counter() - now
        self.made += 1
        return Preview(pixels, self.request.shape, step, self.request.steps)

