"""Fit the embedded models' latent→RGB preview maps from their own VAEs and write acceldemo/models/latent_rgb.json:
`python -m training.latent_rgb` (under a minute on one CPU thread; offline, deterministic). Each map is fitted on
latents the model itself finished (48 runs of its example prompts), decoded by its VAE.

A model whose VAE differs from the one a shipped map was fitted from (another build of the tiny models) gets its
map fitted at its first preview instead, and kept in the cache folder (`acceldemo.models.latent_rgb.map_for`)."""
from __future__ import annotations

import argparse
import json
import tempfile

import torch

from acceldemo.config import Settings
from acceldemo.files import write_atomically
from acceldemo.models.catalog import CATALOG
from acceldemo.models.latent_rgb import SHIPPED, fit, unpack
from acceldemo.models.loading import load_pipeline


def _drawn(pipe, spec, runs: int = 48) -> torch.Tensor:
    """Finished latents of the model's own runs (its example prompts, or a few plain ones; several seeds), in the
    VAE's latent space: where the previews' latents lie."""
    prompts = list(spec.example_prompts) or ["a red circle", "a blue square on a yellow background", "a cat"]
    found = []

    def keep(pipeline, step, timestep, tensors):
        if step == spec.steps - 1:
            found.append(unpack(pipeline, spec, tensors["latents"], spec.default_shape.height,
                                spec.default_shape.width))
        return tensors

    pipe.set_progress_bar_config(disable=True)
    for run in range(runs):
        extra = {"max_sequence_length": spec.max_sequence_length} if spec.max_sequence_length else {}
        pipe(prompt=prompts[run % len(prompts)], height=spec.default_shape.height, width=spec.default_shape.width,
             num_inference_steps=spec.steps, guidance_scale=spec.guidance, output_type="latent",
             generator=torch.Generator().manual_seed(run), callback_on_step_end=keep, **extra)
    return torch.cat(found)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.latent_rgb", description=__doc__)
    parser.add_argument("--models", default=",".join(name for name, spec in CATALOG.items()
                                                     if spec.bundled or spec.tiny_family))
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    maps = {}
    with tempfile.TemporaryDirectory() as cache:
        settings = Settings.from_env({"ACCELDEMO_CACHE_DIR": cache})
        for name in args.models.split(","):
            pipe = load_pipeline(CATALOG[name], settings)
            fitted = fit(pipe.vae, drawn=_drawn(pipe, CATALOG[name]))
            maps[name] = fitted.as_json()
            print(f"{name}: {len(fitted.weights[0]) // 2} latent channels, mean error {fitted.error:.1f} of 255 "
                  f"against the VAE's decode", flush=True)
    write_atomically(SHIPPED, json.dumps(maps, indent=1) + "\n")
    print(f"written: {SHIPPED}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
