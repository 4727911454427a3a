"""Train the tiny FLUX.2-klein shapes model on one CPU thread: `python -m acceldemo.models.shapes.train --out DIR`.

Three phases, all seeded:
1. the VAE learns to reconstruct scenes (L1, shape pixels weighted up); its batch-norm
   statistics are then set from the latents of the training images, which the pipeline
   uses to normalise and un-normalise latents;
2. the frozen random text encoder embeds every training caption once, padded to 512
   tokens (the pipeline's default max_sequence_length);
3. the transformer learns rectified flow in the pipeline's own latent space: packed,
   patchified, batch-norm-normalised latents x0, noise e, x_t = (1 - s) x0 + s e, target
   e - x0, timestep s (the pipeline passes scheduler timestep / 1000 = s). Text is cut to a
   random length per batch (an exact cut: the encoder is causal and pads on the right),
   so the model serves any max_sequence_length from the prompt's length up to 512.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from diffusers import AutoencoderKLFlux2, Flux2KleinPipeline, Flux2Transformer2DModel
from tqdm.auto import tqdm

from .architecture import MAX_SEQUENCE_LENGTH, TEXT_OUT_LAYERS, build_pipeline
from .dataset import images_as_tensor, render, training_scenes


@dataclass(frozen=True)
class TrainingPlan:
    """Every knob of a run; the defaults are the committed model's."""

    seed: int = 0
    vae_steps: int = 2500
    vae_batch_size: int = 8
    vae_learning_rate: float = 3e-3
    vae_shape_weight: float = 4.0  # loss weight of shape pixels relative to background pixels
    latent_pool_per_scene: int = 24
    transformer_steps: int = 6000
    transformer_batch_size: int = 16
    short_text_slack: int = 32  # other batches cut text to the prompt's length plus up to this many pads
    long_text_batch_size: int = 4
    long_text_every: int = 8  # every Nth batch uses the full 512 tokens
    transformer_learning_rate: float = 1e-3
    warmup_steps: int = 100
    ema_decay: float = 0.999


def _cosine_learning_rate(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _set_learning_rate(optimizer: torch.optim.Optimizer, value: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = value


def _shape_weighted_l1(reconstruction: torch.Tensor, images: torch.Tensor, shape_weight: float) -> torch.Tensor:
    """L1 where pixels unlike the background (read from the top and bottom rows) weigh more.

    The shape covers about a tenth of the image; unweighted, its colour is learnt last.
    """
    background = torch.cat([images[:, :, 0], images[:, :, -1]], dim=2).median(dim=2).values[:, :, None, None]
    is_shape = (images - background).abs().sum(dim=1, keepdim=True) > 0.2
    weight = 1 + (shape_weight - 1) * is_shape.float()
    return ((reconstruction - images).abs() * weight).mean() / weight.mean()


def train_vae(vae: AutoencoderKLFlux2, plan: TrainingPlan, rng: np.random.Generator) -> float:
    """Train as a plain autoencoder on the posterior mean; returns the mean weighted L1 of the last 100 steps.

    The pipeline only ever uses the posterior mean (`mode()`), so the variance is left untrained.
    """
    scenes = training_scenes()
    optimizer = torch.optim.AdamW(vae.parameters(), lr=plan.vae_learning_rate, weight_decay=0.0)
    vae.train()
    recent: list[float] = []
    progress = tqdm(range(plan.vae_steps), desc="vae", unit="step")
    for step in progress:
        _set_learning_rate(optimizer, _cosine_learning_rate(step, plan.vae_steps, plan.vae_learning_rate, 50))
        picks = rng.integers(len(scenes), size=plan.vae_batch_size)
        images = images_as_tensor([render(scenes[i], seed=int(rng.integers(2**31))) for i in picks])
        reconstruction = vae.decode(vae.encode(images).latent_dist.mode()).sample
        loss = _shape_weighted_l1(reconstruction, images, plan.vae_shape_weight)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        optimizer.step()
        recent = (recent + [loss.item()])[-100:]
        progress.set_postfix(loss=f"{np.mean(recent):.4f}")
    vae.eval()
    return float(np.mean(recent))


@torch.no_grad()
def encode_latent_pool(pipe: Flux2KleinPipeline, plan: TrainingPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed latents (N, tokens, channels) of jittered training images, and each one's scene index.

    Also sets the VAE's batch-norm running statistics from these latents: the pipeline divides
    and multiplies by exactly these, so the transformer works on unit-scale tokens.
    """
    scenes = training_scenes()
    scene_index = torch.arange(len(scenes)).repeat_interleave(plan.latent_pool_per_scene)
    patchified = []
    for chunk in tqdm(scene_index.split(64), desc="encode images", unit="batch"):
        images = images_as_tensor([render(scenes[int(i)], seed=plan.seed * 1_000_003 + k) for k, i in enumerate(chunk)])
        latents = pipe.vae.encode(images).latent_dist.mode()
        patchified.append(Flux2KleinPipeline._patchify_latents(latents))
    patchified = torch.cat(patchified)
    bn = pipe.vae.bn
    bn.running_mean.copy_(patchified.mean(dim=(0, 2, 3)))
    bn.running_var.copy_(patchified.var(dim=(0, 2, 3)))
    bn.num_batches_tracked.fill_(1)
    mean = bn.running_mean.view(1, -1, 1, 1)
    std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + pipe.vae.config.batch_norm_eps)
    return Flux2KleinPipeline._pack_latents((patchified - mean) / std), scene_index


@torch.no_grad()
def encode_captions(pipe: Flux2KleinPipeline) -> tuple[torch.Tensor, int]:
    """Prompt embeddings of every training caption at 512 tokens, and the longest prompt's token count."""
    captions = [scene.caption for scene in training_scenes()]
    embeddings = [
        pipe.encode_prompt(prompt=chunk, device="cpu", max_sequence_length=MAX_SEQUENCE_LENGTH,
                           text_encoder_out_layers=TEXT_OUT_LAYERS)[0]
        for chunk in tqdm([captions[i : i + 16] for i in range(0, len(captions), 16)], desc="encode captions")
    ]
    longest = max(len(pipe.tokenizer(_chat_text(pipe, caption))["input_ids"]) for caption in captions)
    return torch.cat(embeddings), longest


def _chat_text(pipe: Flux2KleinPipeline, caption: str) -> str:
    return pipe.tokenizer.apply_chat_template(
        [{"role": "user", "content": caption}], tokenize=False, add_generation_prompt=True, enable_thinking=False
    )


def _sample_sigmas(batch_size: int, generator: torch.Generator) -> torch.Tensor:
    """Noise levels weighted like the pipeline's schedules at 64 px (exponential shift, mu 1.6–1.95 for 50–4 steps).

    A quarter are uniform so that long schedules' low-noise steps are covered too.
    """
    u = torch.rand(batch_size, generator=generator).clamp(1e-4, 1 - 1e-4)
    mu = 1.5 + 0.5 * torch.rand(batch_size, generator=generator)
    shifted = torch.exp(mu) / (torch.exp(mu) + (1 / u - 1))
    uniform = torch.rand(batch_size, generator=generator) < 0.25
    return torch.where(uniform, u, shifted)


def flow_matching_loss(
    transformer: Flux2Transformer2DModel,
    clean: torch.Tensor,
    prompt_embeds: torch.Tensor,
    generator: torch.Generator,
) -> torch.Tensor:
    """MSE between the predicted and the true velocity (noise - clean) at random noise levels."""
    batch_size = clean.shape[0]
    sigmas = _sample_sigmas(batch_size, generator)
    noise = torch.randn(clean.shape, generator=generator)
    noisy = (1 - sigmas.view(-1, 1, 1)) * clean + sigmas.view(-1, 1, 1) * noise
    side = int(math.isqrt(clean.shape[1]))
    img_ids = Flux2KleinPipeline._prepare_latent_ids(clean.new_zeros(batch_size, 1, side, side))
    txt_ids = Flux2KleinPipeline._prepare_text_ids(prompt_embeds)
    prediction = transformer(
        hidden_states=noisy,
        encoder_hidden_states=prompt_embeds,
        timestep=sigmas,
        img_ids=img_ids,
        txt_ids=txt_ids,
        guidance=None,
        return_dict=False,
    )[0]
    return torch.nn.functional.mse_loss(prediction, noise - clean)


def train_transformer(
    transformer: Flux2Transformer2DModel,
    latent_pool: torch.Tensor,
    scene_index: torch.Tensor,
    caption_embeddings: torch.Tensor,
    prompt_tokens: int,
    plan: TrainingPlan,
) -> tuple[dict[str, torch.Tensor], float]:
    """Returns the EMA weights and the mean loss of the last 200 steps."""
    generator = torch.Generator().manual_seed(plan.seed + 1)
    optimizer = torch.optim.AdamW(transformer.parameters(), lr=plan.transformer_learning_rate, weight_decay=0.01)
    ema = {name: value.detach().clone() for name, value in transformer.state_dict().items()}
    transformer.train()
    recent: list[float] = []
    progress = tqdm(range(plan.transformer_steps), desc="transformer", unit="step")
    for step in progress:
        lr = _cosine_learning_rate(step, plan.transformer_steps, plan.transformer_learning_rate, plan.warmup_steps)
        _set_learning_rate(optimizer, lr)
        if step % plan.long_text_every == plan.long_text_every - 1:
            batch_size, text_length = plan.long_text_batch_size, MAX_SEQUENCE_LENGTH
        else:
            batch_size = plan.transformer_batch_size
            text_length = prompt_tokens + int(torch.randint(plan.short_text_slack, (1,), generator=generator))
        picks = torch.randint(len(latent_pool), (batch_size,), generator=generator)
        loss = flow_matching_loss(
            transformer,
            latent_pool[picks],
            caption_embeddings[scene_index[picks], :text_length],
            generator,
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(transformer.parameters(), 1.0)
        optimizer.step()
        with torch.no_grad():
            decay = min(plan.ema_decay, (1 + step) / (10 + step))
            for name, value in transformer.state_dict().items():
                ema[name].lerp_(value, 1 - decay)
        recent = (recent + [loss.item()])[-200:]
        progress.set_postfix(loss=f"{np.mean(recent):.4f}", lr=f"{lr:.1e}")
    transformer.eval()
    return ema, float(np.mean(recent))


def train(out: Path, plan: TrainingPlan) -> dict:
    torch.set_num_threads(1)
    started = time.monotonic()
    pipe = build_pipeline(plan.seed)
    pipe.text_encoder.requires_grad_(False)
    rng = np.random.default_rng(plan.seed)

    vae_loss = train_vae(pipe.vae, plan, rng)
    pipe.vae.requires_grad_(False)
    latent_pool, scene_index = encode_latent_pool(pipe, plan)
    caption_embeddings, longest_prompt = encode_captions(pipe)
    ema, transformer_loss = train_transformer(
        pipe.transformer, latent_pool, scene_index, caption_embeddings, longest_prompt, plan
    )
    pipe.transformer.load_state_dict(ema)
    pipe.save_pretrained(out)

    summary = {
        "plan": asdict(plan),
        "vae_loss_last_100_steps": vae_loss,
        "transformer_loss_last_200_steps": transformer_loss,
        "longest_training_prompt_tokens": longest_prompt,
        "training_seconds": round(time.monotonic() - started, 1),
        "torch_threads": torch.get_num_threads(),
    }
    (out / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the saved pipeline")
    defaults = TrainingPlan()
    for field, value in asdict(defaults).items():
        parser.add_argument(f"--{field.replace('_', '-')}", type=type(value), default=value)
    args = parser.parse_args(argv)
    plan = TrainingPlan(**{field: getattr(args, field) for field in asdict(defaults)})
    summary = train(args.out, plan)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
