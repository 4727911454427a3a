"""Each model's linear latent→RGB map (ComfyUI's latent2rgb approach): how its denoising latents are unpacked into the
VAE's own latent space, and a 3×2C matrix plus bias that turns one latent pixel (its C values and their squares)
into one RGB pixel, fitted from the model's own VAE. The embedded models' maps ship in latent_rgb.json
(`python -m training.latent_rgb`); any other model's is fitted on its first preview and kept in the cache folder."""
from __future__ import annotations

import hashlib
import json
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

from ..files import write_atomically
from .catalog import ModelSpec
from .families import PipelineFamily

log = logging.getLogger("acceldemo.previews")
SHIPPED = Path(__file__).with_name("latent_rgb.json")
# How the pipelines of each class hand latents to `callback_on_step_end`.
PACKED_2X2_IDS = "flux2"  # (B, h/2·w/2, 4C) tokens in row order, batch-normalised: FLUX.2 and FLUX.2-klein
PACKED_2X2 = "flux1"  # (B, h/2·w/2, 4C) tokens of 2×2 patches, scaled and shifted: FLUX.1
SCALED = "sd3"  # (B, C, h, w), scaled and shifted: SD3
LAYOUTS = {PipelineFamily.FLUX2_KLEIN: PACKED_2X2_IDS, PipelineFamily.FLUX2: PACKED_2X2_IDS,
           PipelineFamily.FLUX1: PACKED_2X2, PipelineFamily.SD3: SCALED}
_FIT_LOCK = threading.Lock()


@dataclass(frozen=True)
class LatentRGB:
    """RGB in [-1, 1] = weights · (latent, latent²) + bias, per latent pixel; `vae` names the VAE it was fitted from.

    ComfyUI's maps are linear in the latent alone; the squares halve the error for a VAE as far from linear as
    tiny-shapes' (33 → 17 of 255 against its own decode) and cost one more multiply per value."""

    weights: tuple[tuple[float, ...], ...]  # 3 rows of 2C: the C latent channels, then their squares
    bias: tuple[float, float, float]
    vae: str
    # Mean absolute error of the fit against the VAE's own decode, in [0, 255] (how close a preview comes).
    error: float = 0.0

    def as_json(self) -> dict:
        return {"weights": [list(row) for row in self.weights], "bias": list(self.bias), "vae": self.vae,
                "error": self.error}

    @staticmethod
    def of_json(data: dict) -> LatentRGB:
        return LatentRGB(tuple(tuple(row) for row in data["weights"]), tuple(data["bias"]), data["vae"],
                         data.get("error", 0.0))


def vae_fingerprint(vae) -> str:
    """What identifies a VAE's decoding: its config and a digest of its decoder's weights (a map fitted from one VAE
    is never used with another)."""
    import torch

    # The config's public fields only: `_name_or_path` is where this host keeps the files.
    public = {key: value for key, value in dict(vae.config).items() if not key.startswith("_")}
    digest = hashlib.sha256(json.dumps(public, sort_keys=True, default=str).encode())
    with torch.no_grad():
        for name, tensor in sorted(vae.state_dict().items()):
            if name.startswith(("decoder.", "post_quant_conv.", "bn.")) and tensor.is_floating_point():
                flat = tensor.detach().float().flatten()
                digest.update(f"{name}:{tuple(tensor.shape)}:{flat.sum().item():.6e}:{flat.abs().sum().item():.6e}:"
                              f"{flat[: min(8, flat.numel())].tolist()}".encode())
    return digest.hexdigest()[:16]


def unpack(pipe, spec: ModelSpec, latents, height: int, width: int):
    """The callback's latents as the VAE's own latents (B, C, h, w), as the pipeline itself does before decoding."""
    layout = LAYOUTS[spec.family]
    vae = pipe.vae
    if layout == PACKED_2X2_IDS:
        import torch

        # Text-to-image latent ids are the cartesian product of rows and columns: tokens are in row order.
        rows, cols = height // (pipe.vae_scale_factor * 2), width // (pipe.vae_scale_factor * 2)
        grid = latents.reshape(latents.shape[0], rows, cols, latents.shape[-1]).permute(0, 3, 1, 2)
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(grid.device, grid.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(grid.device, grid.dtype)
        return pipe._unpatchify_latents(grid * std + mean)
    if layout == PACKED_2X2:
        latents = pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor)
    scale, shift = vae.config.get("scaling_factor") or 1.0, vae.config.get("shift_factor") or 0.0
    return latents / scale + shift


def fit(vae, drawn=None, size: int = 64, images: int = 48, seed: int = 0) -> LatentRGB:
    """Least squares from the VAE's latents to its own decode of them, per latent pixel.

    The latents: `drawn`, latents (N, C, h, w) the model itself finished (what the offline fit of the embedded
    models uses: a small transformer's latents can lie far from its encoder's, and tiny-shapes' map fitted on
    encodings is off by 45 of 255 on its own drawings, 17 when fitted on them); else the VAE's encodings of
    synthetic pictures (flat colours, gradients, discs and boxes of random and of saturated colours), as a real
    model's transformer draws latents its VAE would encode. Clean latents: the previews show the model's prediction
    of the finished latents (see `executors.previews`), not a step's noisy ones. The targets are the VAE's decodes,
    averaged down to the latent grid: the map predicts what the decode will show.
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    device, dtype = next(vae.parameters()).device, next(vae.parameters()).dtype
    with torch.no_grad():
        if drawn is None:
            latents = torch.cat([vae.encode(batch.to(device, dtype)).latent_dist.mode().float()
                                 for batch in _pictures(images, size, generator).split(8)])
        else:
            latents = drawn.to(device, torch.float32)
        decoded = torch.cat([vae.decode(batch.to(dtype), return_dict=False)[0].float().clamp(-1, 1)
                             for batch in latents.split(8)])
        target = torch.nn.functional.adaptive_avg_pool2d(decoded, latents.shape[-2:])
        x = latents.permute(0, 2, 3, 1).reshape(-1, latents.shape[1]).cpu()
        y = target.permute(0, 2, 3, 1).reshape(-1, 3).cpu()
        design = torch.cat([x, x * x, torch.ones(len(x), 1)], dim=1).double()
        solution = torch.linalg.lstsq(design, y.double()).solution  # (C + 1, 3)
        error = ((design @ solution).clamp(-1, 1) - y.double()).abs().mean().item() * 127.5
    weights = tuple(tuple(float(v) for v in solution[:-1, c]) for c in range(3))
    return LatentRGB(weights, tuple(float(v) for v in solution[-1]), vae_fingerprint(vae), error)


def _pictures(count: int, size: int, generator):
    """Synthetic RGB pictures in [-1, 1]: a background colour or gradient with one or two shapes on it."""
    import torch

    ys, xs = torch.meshgrid(torch.linspace(0, 1, size), torch.linspace(0, 1, size), indexing="ij")
    out = []
    for i in range(count):
        # Every other picture in the eight saturated colours (each channel off or on): a VAE trained on a few
        # colours (tiny-shapes) encodes those faithfully and others not at all.
        colours = torch.rand(4, 3, 1, 1, generator=generator) * 2 - 1
        if i % 2:
            colours = colours.sign()
        t = xs if i % 3 == 0 else ys if i % 3 == 1 else torch.zeros_like(xs)
        t = t if i % 2 == 0 else t.round()  # saturated pictures: two halves, not a gradient
        picture = colours[0] * (1 - t) + colours[1] * t
        for shape in range(1 + i % 2):
            cx, cy, r = (torch.rand(3, generator=generator) * torch.tensor([0.8, 0.8, 0.3]) + torch.tensor(
                [0.1, 0.1, 0.1])).tolist()
            inside = ((xs - cx) ** 2 + (ys - cy) ** 2 < r * r) if shape == 0 else \
                ((xs - cx).abs() < r) & ((ys - cy).abs() < r)
            picture = torch.where(inside, colours[2 + shape].expand(3, size, size), picture)
        out.append(picture)
    return torch.stack(out)


def shipped_maps() -> dict[str, dict]:
    try:
        return json.loads(SHIPPED.read_text())
    except FileNotFoundError:
        return {}


def map_for(spec: ModelSpec, vae, cache_dir: Path) -> LatentRGB:
    """The model's map for this VAE: the one shipped with the app, else the one fitted here before (cache folder),
    else fitted now (a few VAE calls at 64 px) and kept."""
    fingerprint = vae_fingerprint(vae)
    shipped = shipped_maps().get(spec.name)
    if shipped and shipped["vae"] == fingerprint:
        return LatentRGB.of_json(shipped)
    path = cache_dir / "latent_rgb" / f"{spec.name}.json"
    with _FIT_LOCK:
        try:
            kept = json.loads(path.read_text())
            if kept["vae"] == fingerprint:
                return LatentRGB.of_json(kept)
        except (OSError, ValueError, KeyError):
            pass
        log.info("fitting the latent→RGB preview map of %s from its VAE", spec.name)
        fitted = fit(vae)
        write_atomically(path, json.dumps(fitted.as_json(), indent=1))
        return fitted
