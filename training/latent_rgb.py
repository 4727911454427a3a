"""Fit the embedded models' latent→RGB preview maps from their own VAEs and write acceldemo/models/latent_rgb.json:
`python -m training.latent_rgb` (a few seconds on one CPU thread; offline, deterministic).

A model whose VAE differs from the one a shipped map was fitted from (another build of the tiny models) gets its
map fitted at its first preview instead, and kept in the cache folder (`acceldemo.models.latent_rgb.map_for`)."""
from __future__ import annotations

import argparse
import json
import tempfile

import torch

from acceldemo.config import Settings
from acceldemo.models.catalog import CATALOG
from acceldemo.files import write_atomically
from acceldemo.models.latent_rgb import SHIPPED, fit
from acceldemo.models.loading import load_pipeline


def _shapes_pictures() -> torch.Tensor:
    """tiny-shapes' own training drawings, at its four sizes' smallest: the pictures its VAE was trained on."""
    from training.shapes.dataset import images_as_tensor, render, training_scenes

    scenes = training_scenes()
    return images_as_tensor([render(scenes[(i * 37) % len(scenes)], seed=i) for i in range(48)])


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
            fitted = fit(pipe.vae, pictures=_shapes_pictures() if name == "tiny-shapes" else None)
            maps[name] = fitted.as_json()
            print(f"{name}: {len(fitted.weights[0]) // 2} latent channels, mean error {fitted.error:.1f} of 255 "
                  f"against the VAE's decode", flush=True)
    write_atomically(SHIPPED, json.dumps(maps, indent=1) + "\n")
    print(f"written: {SHIPPED}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
