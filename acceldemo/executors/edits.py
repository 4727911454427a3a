"""An edit's pipeline call: what each model's way of editing adds to the text-to-image call.

- "reference" (FLUX.2): the pictures go to the pipeline as `image=` (reference tokens the transformer attends to).
- "strength" on a FLUX.2 pipeline (the embedded tiny-shapes): diffusers has no FLUX.2 image-to-image pipeline, so
  the call is the text-to-image pipeline given the tail of its own sigma schedule and, as latents, the picture's
  latents noised to the first of those sigmas (what diffusers' image-to-image pipelines do); with a mask the region
  outside it is put back after every step, noised to that step's sigma (as its inpainting pipelines do).
- "strength" elsewhere (FLUX.1, SD3): diffusers' own image-to-image pipeline made from the loaded one (`from_pipe`:
  the same modules, the compiled transformer included).
- "inpaint" (a mask): on the embedded tiny-shapes the strength path above with its mask; elsewhere diffusers' own
  inpainting pipeline of the family, made the same way (FLUX.1, SD3: `AutoPipelineForInpainting`; FLUX.2 klein:
  `Flux2KleinInpaintPipeline`, which has no auto mapping), given the picture, the mask and the strength.
"""
from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..models.families import PipelineFamily
from ..records import Batch, EditMethod

if TYPE_CHECKING:
    from .prepared import PreparedPipeline


def _made_from(prepared: PreparedPipeline, method: EditMethod):
    """Diffusers' image-to-image ("strength") or inpainting ("inpaint") pipeline of the prepared pipeline's family,
    on its modules; made once per pipeline and kept with it."""
    made = prepared.edit_pipes.get(method)
    if made is None:
        import diffusers

        if method == EditMethod.INPAINT and prepared.spec.family is PipelineFamily.FLUX2_KLEIN:
            made = diffusers.Flux2KleinInpaintPipeline.from_pipe(prepared.pipe)
        else:
            auto = (diffusers.AutoPipelineForInpainting if method == EditMethod.INPAINT
                    else diffusers.AutoPipelineForImage2Image)
            made = auto.from_pipe(prepared.pipe)
        made.set_progress_bar_config(disable=True)
        prepared.edit_pipes[method] = made
    return made


class EditCall:
    """The pipeline to call and what to add to its arguments; `after_step` puts the unmasked region back."""

    def __init__(self, prepared: PreparedPipeline, batch: Batch, kwargs: dict):
        self.pipe, self.kwargs = prepared.pipe, kwargs
        self.after_step: Callable[[int, dict], None] = lambda i, tensors: None
        edit = batch.first.edit
        if edit is None:
            return
        pictures = edit.pictures()
        if edit.method == EditMethod.REFERENCE:
            kwargs["image"] = pictures
        elif prepared.spec.family.flux2 and not batch.first.graph.reference_edits:
            self._own_image_to_image(batch, pictures[0], edit)
        else:
            self.pipe = _made_from(prepared, edit.method)
            kwargs.update(image=pictures[0], strength=edit.strength)
            if edit.method == EditMethod.INPAINT:
                kwargs["mask_image"] = edit.mask_picture()

    def _own_image_to_image(self, batch: Batch, picture, edit) -> None:
        import numpy as np
        import torch
        from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu
        from diffusers.utils.torch_utils import randn_tensor

        pipe, request = self.pipe, batch.first
        steps = request.steps
        first = steps - request.denoise_steps
        with torch.no_grad():
            pixels = pipe.image_processor.preprocess(picture, height=request.height, width=request.width)
            pixels = pixels.to(pipe._execution_device, pipe.vae.dtype)
            clean = pipe._encode_vae_image(pixels, generator=None)  # (1, C, h, w), normalised as the pipeline's
        generators = self.kwargs["generator"]
        generators = generators if isinstance(generators, list) else [generators]
        shape = (len(generators), *clean.shape[1:])
        noise = randn_tensor(shape, generator=generators, device=clean.device, dtype=clean.dtype)
        clean = clean.expand(shape)
        # The tail of the schedule the pipeline would use (mu from the full step count: the same shifted sigmas).
        sigmas = np.linspace(1.0, 1 / steps, steps)[first:]
        schedule = copy.deepcopy(pipe.scheduler)
        mu = compute_empirical_mu(image_seq_len=clean.shape[2] * clean.shape[3], num_steps=steps)
        schedule.set_timesteps(sigmas=sigmas, mu=mu, device=clean.device)
        shifted = schedule.sigmas.to(clean.dtype)
        self.kwargs.update(sigmas=list(sigmas), latents=shifted[0] * noise + (1 - shifted[0]) * clean)
        region = edit.mask_picture()
        if region is None:
            return
        # The mask at the latents' grid, packed as the pipeline packs its latents: (B, tokens, 1), 1 where it changes.
        grid = torch.from_numpy(np.asarray(region.resize((clean.shape[3], clean.shape[2])), dtype=np.float32) / 255)
        changes = (grid > 0.5).to(clean.dtype).reshape(1, -1, 1).to(clean.device)
        clean_packed, noise_packed = pipe._pack_latents(clean), pipe._pack_latents(noise)

        def keep_the_rest(i: int, tensors: dict) -> None:
            sigma = shifted[i + 1]
            kept = sigma * noise_packed + (1 - sigma) * clean_packed
            tensors["latents"] = changes * tensors["latents"] + (1 - changes) * kept.to(tensors["latents"].dtype)

        self.after_step = keep_the_rest
