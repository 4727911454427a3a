"""Train the tiny FLUX.2-klein shapes model on one CPU thread: `python -m training.shapes.train --out DIR`.

Four phases, all seeded:
0. the text encoder learns to read captions: at every token from the end of the caption on
   (the chat template's closing tokens and any padding) its prompt embedding must be the
   caption's code, a sum of one fixed random vector per part it names (shape, colour,
   background, position; another for a part left out), and zero before, whatever the phrasing,
   letter case or punctuation (`train_text_encoder`);
1. the VAE learns to reconstruct scenes (L1, shape pixels weighted up);
2. jittered drawings of every training scene are encoded at every supported size, and the
   VAE's batch-norm statistics are set from these latents (the pipeline normalises and
   un-normalises latents with exactly these);
3. the transformer learns rectified flow in the pipeline's own latent space: packed,
   patchified, batch-norm-normalised latents x0, noise e, x_t = (1 - s) x0 + s e, target
   e - x0, timestep s (the pipeline passes scheduler timestep / 1000 = s). Each batch is one
   size, the sizes in turn; each image gets a fresh caption in a random phrasing family
   (never a held-out one, nor one whose completed scene is held out: `dataset.is_trained_on`),
   encoded by the now frozen text encoder on the spot, paired with a drawing of the scene it
   asks for, completed by the defaults where it leaves parts out (`dataset.scene_drawn_for`). Text is cut to a random
   length per batch (an exact cut: the encoder is causal and pads on the right), so the model
   serves any max_sequence_length from the prompt's length up to 512.

`--text-and-vae-from DIR` keeps a saved pipeline's tokenizer, text encoder and VAE (phases 0 and 1
skipped; 2 sets the batch-norm statistics again), `--transformer-from DIR` trains on from its
transformer; the summary records where they came from. Every `--checkpoint-every` steps the EMA
transformer is written into `--out`, which is a loadable pipeline from the start of phase 3 on
(`checkpoint.json` names the step; it is removed when the run ends).
"""
from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from diffusers import AutoencoderKLFlux2, Flux2KleinPipeline, Flux2Transformer2DModel
from tqdm.auto import tqdm

from acceldemo.models.shapes import TRAINED_SIZES as SIZES
from acceldemo.models.shapes.phrasing import COLOURS, POSITIONS, SHAPES, Caption

from .architecture import (
    MAX_SEQUENCE_LENGTH,
    ROPE_AXES,
    TEXT_HIDDEN_SIZE,
    TEXT_OUT_LAYERS,
    TRANSFORMER_BLOCKS,
    build_pipeline,
)
from .dataset import images_as_tensor, render, scene_drawn_for, training_caption, training_scenes


@dataclass(frozen=True)
class TrainingPlan:
    """Every knob of a run; the defaults are the committed model's."""

    seed: int = 0
    vae_steps: int = 2500
    vae_batch_size: int = 8
    vae_learning_rate: float = 3e-3
    vae_shape_weight: float = 4.0  # loss weight of shape pixels relative to background pixels
    latent_pool_per_scene: int = 16  # jittered drawings of each training scene, at each size
    text_steps: int = 1500
    text_batch_size: int = 32
    text_learning_rate: float = 3e-3
    transformer_steps: int = 12000
    tokens_per_batch: int = 1024  # batch size × image tokens: 16 images at 64×64, 4 at 128×128
    short_text_slack: int = 32  # other batches cut text to the longest prompt plus up to this many pads
    long_text_batch_size: int = 4
    long_text_every: int = 16  # every Nth batch uses the full 512 tokens
    transformer_learning_rate: float = 1e-3
    transformer_weight_decay: float = 0.01  # AdamW's decoupled weight decay on the transformer
    transformer_shape_weight: float = 4.0  # loss weight of a token covered by the shape, relative to background
    warmup_steps: int = 100
    ema_decay: float = 0.999
    rope_axes: str = ",".join(map(str, ROPE_AXES))  # the transformer's rotary dims per position axis (t, h, w, l)
    # The transformer's double-stream and single-stream block counts. A --transformer-from with fewer
    # blocks is grown: its blocks keep their places and weights, each new one starts as the identity.
    transformer_blocks: str = ",".join(map(str, TRANSFORMER_BLOCKS))
    size_schedule: str = "0,1,2,3"  # indices into SIZES: the transformer's batches take the sizes in this cycle
    checkpoint_every: int = 500  # transformer steps between saves of the EMA weights to --out (0: only at the end)
    # A saved pipeline whose tokenizer, text encoder and VAE to keep (phases 0 and 1 skipped); empty: train them.
    text_and_vae_from: str = ""
    # A saved pipeline whose transformer to train on from (its rotary dims must be rope_axes); empty: fresh weights.
    transformer_from: str = ""

    @property
    def axes_dims_rope(self) -> tuple[int, ...]:
        return tuple(int(part) for part in self.rope_axes.split(","))

    @property
    def blocks(self) -> tuple[int, int]:
        parts = self.transformer_blocks.split(",")
        if len(parts) != 2 or not all(part.strip().isdigit() and int(part) > 0 for part in parts):
            raise ValueError(f"transformer_blocks={self.transformer_blocks!r}: two positive counts, "
                             "double-stream and single-stream blocks, comma-separated")
        return int(parts[0]), int(parts[1])

    @property
    def size_cycle(self) -> list[int]:
        cycle = [int(part) for part in self.size_schedule.split(",")]
        if not cycle or not all(0 <= index < len(SIZES) for index in cycle):
            raise ValueError(f"size_schedule={self.size_schedule!r}: indices into {len(SIZES)} sizes, comma-separated")
        return cycle


def _cosine_learning_rate(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _set_learning_rate(optimizer: torch.optim.Optimizer, value: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = value


def _shape_is_where(images: torch.Tensor) -> torch.Tensor:
    """(N, 1, H, W): pixels unlike the background, read from the top and bottom rows."""
    background = torch.cat([images[:, :, 0], images[:, :, -1]], dim=2).median(dim=2).values[:, :, None, None]
    return (images - background).abs().sum(dim=1, keepdim=True) > 0.2


def _shape_weighted_l1(reconstruction: torch.Tensor, images: torch.Tensor, shape_weight: float) -> torch.Tensor:
    """L1 where pixels unlike the background (read from the top and bottom rows) weigh more.

    The shape covers about a tenth of the image; unweighted, its colour is learnt last.
    """
    weight = 1 + (shape_weight - 1) * _shape_is_where(images).float()
    return ((reconstruction - images).abs() * weight).mean() / weight.mean()


def train_vae(vae: AutoencoderKLFlux2, plan: TrainingPlan, rng: np.random.Generator) -> float:
    """Train as a plain autoencoder on the posterior mean at the smallest size; returns the mean weighted
    L1 of the last 100 steps.

    The pipeline only ever uses the posterior mean (`mode()`), so the variance is left untrained.
    Being convolutional, the VAE trained at 64×64 reconstructs the larger sizes as well (the
    evaluation checks every size); batches mixing in 128-pixel images learnt slower and drew
    worse squares at 64×64.
    """
    scenes = training_scenes()
    optimizer = torch.optim.AdamW(vae.parameters(), lr=plan.vae_learning_rate, weight_decay=0.0)
    vae.train()
    recent: list[float] = []
    progress = tqdm(range(plan.vae_steps), desc="vae", unit="step")
    for step in progress:
        _set_learning_rate(optimizer, _cosine_learning_rate(step, plan.vae_steps, plan.vae_learning_rate, 50))
        picks = rng.integers(len(scenes), size=plan.vae_batch_size)
        images = images_as_tensor([render(scenes[i], *SIZES[0], seed=int(rng.integers(2**31))) for i in picks])
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


@dataclass(frozen=True)
class LatentPool:
    """Packed, normalised latents (N, tokens, channels) of jittered drawings at one size: `per_scene`
    drawings of each training scene in turn; with each token's loss weight (N, tokens)."""

    width: int
    height: int
    latents: torch.Tensor
    token_weights: torch.Tensor
    per_scene: int

    @property
    def token_grid(self) -> tuple[int, int]:
        """(rows, columns) of latent tokens: the VAE's 4× and the 2× patchify."""
        return self.height // 8, self.width // 8


def _shape_token_weights(images: torch.Tensor, shape_weight: float) -> torch.Tensor:
    """(N, tokens): 1 plus (shape_weight - 1) times the share of shape pixels under each latent token
    (an 8×8 patch), in the packed token order."""
    coverage = torch.nn.functional.avg_pool2d(_shape_is_where(images).float(), kernel_size=8)
    return (1 + (shape_weight - 1) * coverage).flatten(start_dim=1)


@torch.no_grad()
def encode_latent_pools(
    pipe: Flux2KleinPipeline, plan: TrainingPlan, style: str = "filled", set_statistics: bool = True
) -> list[LatentPool]:
    """One pool per supported size, of drawings in `style` (`dataset.render`).

    With `set_statistics` (base training), also sets the VAE's batch-norm running statistics from all
    these latents: the pipeline divides and multiplies by exactly these, so the transformer works on
    unit-scale tokens. Without (a LoRA on a trained pipeline), the VAE's statistics are kept and used.
    """
    scenes = training_scenes()
    scene_index = torch.arange(len(scenes)).repeat_interleave(plan.latent_pool_per_scene)
    patchified: list[torch.Tensor] = []
    token_weights: list[torch.Tensor] = []
    for size_index, (width, height) in enumerate(SIZES):
        chunks, weights = [], []
        for start in tqdm(range(0, len(scene_index), 64), desc=f"encode {width}x{height}", unit="batch"):
            images = images_as_tensor([
                render(scenes[int(i)], width, height, seed=(plan.seed * len(SIZES) + size_index) * 1_000_003 + k,
                       style=style)
                for k, i in enumerate(scene_index[start : start + 64].tolist(), start)
            ])
            chunks.append(Flux2KleinPipeline._patchify_latents(pipe.vae.encode(images).latent_dist.mode()))
            weights.append(_shape_token_weights(images, plan.transformer_shape_weight))
        patchified.append(torch.cat(chunks))
        token_weights.append(torch.cat(weights))
    bn = pipe.vae.bn
    if set_statistics:
        channels_last = torch.cat([p.permute(0, 2, 3, 1).reshape(-1, p.shape[1]) for p in patchified])
        bn.running_mean.copy_(channels_last.mean(dim=0))
        bn.running_var.copy_(channels_last.var(dim=0))
        bn.num_batches_tracked.fill_(1)
    mean = bn.running_mean.view(1, -1, 1, 1)
    std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + pipe.vae.config.batch_norm_eps)
    return [
        LatentPool(width, height, Flux2KleinPipeline._pack_latents((p - mean) / std), weights,
                   plan.latent_pool_per_scene)
        for (width, height), p, weights in zip(SIZES, patchified, token_weights, strict=True)
    ]


def _chat_text(pipe: Flux2KleinPipeline, caption: str) -> str:
    return pipe.tokenizer.apply_chat_template(
        [{"role": "user", "content": caption}], tokenize=False, add_generation_prompt=True, enable_thinking=False
    )


@torch.no_grad()
def encode_captions(pipe: Flux2KleinPipeline, captions: list[str], slack: int) -> torch.Tensor:
    """Prompt embeddings cut to the longest caption's token count plus `slack` pads (at most 512)."""
    longest = max(len(pipe.tokenizer(_chat_text(pipe, caption))["input_ids"]) for caption in captions)
    return pipe.encode_prompt(prompt=captions, device="cpu",
                              max_sequence_length=min(MAX_SEQUENCE_LENGTH, longest + slack),
                              text_encoder_out_layers=TEXT_OUT_LAYERS)[0]


# What the text encoder learns to say about a caption: per part, which word it names (index 0:
# none, the part is left out), as `caption_code`.
READ_PARTS: dict[str, tuple[str, ...]] = {
    "shape": SHAPES, "colour": COLOURS, "background": COLOURS, "position": POSITIONS,
}


def _closing_token_count(pipe: Flux2KleinPipeline) -> int:
    """Tokens the chat template puts after the caption (end of turn, assistant header, empty think block)."""
    marker = "\x00"
    return len(pipe.tokenizer(_chat_text(pipe, marker).split(marker, 1)[1])["input_ids"])


def caption_codes(seed: int) -> dict[str, torch.Tensor]:
    """Per part, one fixed random vector per word (row 0: the part is left out), in the prompt embedding's width.

    A caption's code is the sum over its parts: what the text encoder learns to write at every
    token from the end of the caption on, whatever the phrasing.
    """
    generator = torch.Generator().manual_seed(seed + 4)
    width = len(TEXT_OUT_LAYERS) * TEXT_HIDDEN_SIZE
    return {part: torch.randn(len(words) + 1, width, generator=generator) / 2 for part, words in READ_PARTS.items()}


def caption_code(codes: dict[str, torch.Tensor], caption: Caption) -> torch.Tensor:
    rows = []
    for part, words in READ_PARTS.items():
        word = getattr(caption, part)
        rows.append(codes[part][0 if word is None else words.index(word) + 1])
    return torch.stack(rows).sum(dim=0)


def train_text_encoder(pipe: Flux2KleinPipeline, plan: TrainingPlan) -> tuple[float, float]:
    """Teach the random Qwen3 to read captions; returns the mean loss and accuracy of the last 100 steps.

    The prompt embedding (its hidden states at the pipeline's out layers) must be zero at the
    chat template's opening and the caption's tokens, and the caption's code (`caption_code`:
    which shape, colour, background and position it names, or that it leaves one out) at every
    token after the caption: the closing tokens and any padding up to 512. Those tokens follow
    the caption, so the causal encoder can gather all of it there, whatever the word order. The
    transformer is then conditioned on what a caption means, not on how it is written. Token
    embeddings stay frozen, so every spelling of a word keeps its shared embedding. Accuracy:
    the share of captions whose embedding at the last closing token is nearest to its own code
    among the codes of every reading of the parts.
    """
    encoder = pipe.text_encoder
    encoder.train()
    encoder.requires_grad_(True)
    encoder.get_input_embeddings().requires_grad_(False)
    codes = caption_codes(plan.seed)
    trainable = [parameter for parameter in encoder.parameters() if parameter.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=plan.text_learning_rate, weight_decay=0.0)
    closing = _closing_token_count(pipe)
    rng = random.Random(plan.seed + 3)
    scenes = training_scenes()
    recent_loss: list[float] = []
    recent_accuracy: list[float] = []
    progress = tqdm(range(plan.text_steps), desc="text encoder", unit="step")
    for step in progress:
        _set_learning_rate(optimizer, _cosine_learning_rate(step, plan.text_steps, plan.text_learning_rate, 50))
        long_text = step % plan.long_text_every == plan.long_text_every - 1
        captions = [training_caption(rng.choice(scenes), rng)
                    for _ in range(plan.long_text_batch_size if long_text else plan.text_batch_size)]
        lengths = [len(pipe.tokenizer(_chat_text(pipe, caption.text))["input_ids"]) for caption in captions]
        cut = MAX_SEQUENCE_LENGTH if long_text else max(lengths) + rng.randrange(plan.short_text_slack)
        embeds = pipe.encode_prompt(prompt=[caption.text for caption in captions], device="cpu",
                                    max_sequence_length=cut, text_encoder_out_layers=TEXT_OUT_LAYERS)[0]
        targets = torch.zeros_like(embeds)
        for row, (caption, length) in enumerate(zip(captions, lengths, strict=True)):
            targets[row, length - closing :] = caption_code(codes, caption)
        loss = (embeds - targets).pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        with torch.no_grad():
            last = embeds[torch.arange(len(captions)), torch.tensor(lengths) - 1]
            own = (last - targets[torch.arange(len(captions)), torch.tensor(lengths) - 1]).norm(dim=1)
            # Exact distances: the matrix-product shortcut errs by more than the margin compared here.
            every = torch.cdist(last, _every_code(codes), compute_mode="donot_use_mm_for_euclid_dist")
            right = (own <= every.min(dim=1).values + 1e-6).float().mean().item()
        recent_loss = (recent_loss + [loss.item()])[-100:]
        recent_accuracy = (recent_accuracy + [right])[-100:]
        progress.set_postfix(loss=f"{np.mean(recent_loss):.4f}", read=f"{np.mean(recent_accuracy):.3f}")
    encoder.eval()
    encoder.requires_grad_(False)
    return float(np.mean(recent_loss)), float(np.mean(recent_accuracy))


def _every_code(codes: dict[str, torch.Tensor]) -> torch.Tensor:
    """The code of every combination of readings, (N, width)."""
    total = torch.zeros(1, next(iter(codes.values())).shape[1])
    for part_codes in codes.values():
        total = (total[:, None, :] + part_codes[None, :, :]).reshape(-1, total.shape[1])
    return total


def _sample_sigmas(batch_size: int, generator: torch.Generator) -> torch.Tensor:
    """Noise levels weighted like the pipeline's schedules at these sizes (exponential shift, mu 1.6–1.97 for
    50–4 steps at 64–256 image tokens).

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
    token_weights: torch.Tensor,
    token_grid: tuple[int, int],
    prompt_embeds: torch.Tensor,
    generator: torch.Generator,
) -> torch.Tensor:
    """MSE between the predicted and the true velocity (noise - clean) at random noise levels, each token
    weighted (shape tokens weigh more: the background is most of the picture and learnt first)."""
    batch_size = clean.shape[0]
    sigmas = _sample_sigmas(batch_size, generator)
    noise = torch.randn(clean.shape, generator=generator)
    noisy = (1 - sigmas.view(-1, 1, 1)) * clean + sigmas.view(-1, 1, 1) * noise
    img_ids = Flux2KleinPipeline._prepare_latent_ids(clean.new_zeros(batch_size, 1, *token_grid))
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
    squared_error = (prediction - (noise - clean)).pow(2).mean(dim=2)
    return (squared_error * token_weights).mean() / token_weights.mean()


def _save_checkpoint(pipe: Flux2KleinPipeline, ema: dict[str, torch.Tensor], out: Path, step: int) -> None:
    """Write the EMA transformer into the pipeline saved at `out` (written whole once), so that `out` is
    loadable and can be evaluated while training goes on; `checkpoint.json` says after which step."""
    shadow = Flux2Transformer2DModel.from_config(pipe.transformer.config)
    shadow.load_state_dict(ema)
    shadow.save_pretrained(out / "transformer")
    (out / "checkpoint.json").write_text(json.dumps({"transformer_step": step}) + "\n")


def train_transformer(
    pipe: Flux2KleinPipeline, pools: list[LatentPool], plan: TrainingPlan, out: Path | None = None
) -> tuple[dict[str, torch.Tensor], float]:
    """Returns the EMA weights and the mean loss of the last 200 steps; saves them to `out` every
    `plan.checkpoint_every` steps."""
    transformer = pipe.transformer
    generator = torch.Generator().manual_seed(plan.seed + 1)
    rng = random.Random(plan.seed + 2)
    scenes = training_scenes()
    scene_number = {scene: i for i, scene in enumerate(scenes)}
    # Only the weights that require grad (all of them in base training; a LoRA's adapters on a frozen base).
    trainable = [parameter for parameter in transformer.parameters() if parameter.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=plan.transformer_learning_rate,
                                  weight_decay=plan.transformer_weight_decay)
    ema = {name: value.detach().clone() for name, value in transformer.state_dict().items()}
    transformer.train()
    recent: list[float] = []
    cycle = plan.size_cycle
    progress = tqdm(range(plan.transformer_steps), desc="transformer", unit="step")
    for step in progress:
        lr = _cosine_learning_rate(step, plan.transformer_steps, plan.transformer_learning_rate, plan.warmup_steps)
        _set_learning_rate(optimizer, lr)
        pool = pools[cycle[step % len(cycle)]]
        rows, columns = pool.token_grid
        if step % plan.long_text_every == plan.long_text_every - 1:
            batch_size, slack = plan.long_text_batch_size, MAX_SEQUENCE_LENGTH
        else:
            batch_size = max(1, plan.tokens_per_batch // (rows * columns))
            slack = rng.randrange(plan.short_text_slack)
        captions = [training_caption(rng.choice(scenes), rng) for _ in range(batch_size)]
        picks = [
            scene_number[scene_drawn_for(caption)] * pool.per_scene + rng.randrange(pool.per_scene)
            for caption in captions
        ]
        loss = flow_matching_loss(
            transformer,
            pool.latents[picks],
            pool.token_weights[picks],
            pool.token_grid,
            encode_captions(pipe, [caption.text for caption in captions], slack),
            generator,
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        with torch.no_grad():
            decay = min(plan.ema_decay, (1 + step) / (10 + step))
            for name, value in transformer.state_dict().items():
                ema[name].lerp_(value, 1 - decay)
        recent = (recent + [loss.item()])[-200:]
        progress.set_postfix(loss=f"{np.mean(recent):.4f}", lr=f"{lr:.1e}")
        if out is not None and plan.checkpoint_every and (step + 1) % plan.checkpoint_every == 0:
            _save_checkpoint(pipe, ema, out, step + 1)
    transformer.eval()
    return ema, float(np.mean(recent))


def train(out: Path, plan: TrainingPlan) -> dict:
    torch.set_num_threads(1)
    started = time.monotonic()
    _ = plan.size_cycle, plan.blocks  # refuse a bad schedule or block count before hours of training
    pipe = build_pipeline(plan.seed, plan.axes_dims_rope, plan.blocks)
    rng = np.random.default_rng(plan.seed)

    if plan.text_and_vae_from:
        earlier = _keep_text_and_vae(pipe, Path(plan.text_and_vae_from))
    else:
        text_loss, text_accuracy = train_text_encoder(pipe, plan)
        vae_loss = train_vae(pipe.vae, plan, rng)
        earlier = {"text_code_loss_last_100_steps": text_loss, "text_code_accuracy_last_100_steps": text_accuracy,
                   "vae_loss_last_100_steps": vae_loss}
    pipe.vae.requires_grad_(False)
    if plan.transformer_from:
        earlier["transformer"] = _keep_transformer(pipe, Path(plan.transformer_from), plan)
    pools = encode_latent_pools(pipe, plan)
    out.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(out)
    ema, transformer_loss = train_transformer(pipe, pools, plan, out)
    pipe.transformer.load_state_dict(ema)
    pipe.save_pretrained(out)
    (out / "checkpoint.json").unlink(missing_ok=True)

    summary = {
        "plan": asdict(plan),
        "sizes": [f"{width}x{height}" for width, height in SIZES],
        **earlier,
        "transformer_loss_last_200_steps": transformer_loss,
        "training_seconds": round(time.monotonic() - started, 1),
        "torch_threads": torch.get_num_threads(),
    }
    (out / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _training_summary(source: Path) -> dict:
    """The training_summary.json saved beside a pipeline; empty where there is none."""
    summary_file = source / "training_summary.json"
    return json.loads(summary_file.read_text()) if summary_file.exists() else {}


def _keep_text_and_vae(pipe: Flux2KleinPipeline, source: Path) -> dict:
    """Put the tokenizer, text encoder and VAE saved at `source` into `pipe`; returns what its
    training_summary.json says of how they were trained (under "text_and_vae")."""
    loaded = Flux2KleinPipeline.from_pretrained(source, transformer=None)
    pipe.tokenizer, pipe.text_encoder, pipe.vae = loaded.tokenizer, loaded.text_encoder.eval(), loaded.vae.eval()
    pipe.text_encoder.requires_grad_(False)
    earlier = _training_summary(source)
    if "text_and_vae" in earlier:  # `source` kept them from a run before it: that run's record
        kept = {key: value for key, value in earlier["text_and_vae"].items() if key != "from"}
    else:
        kept = {key: value for key, value in earlier.items() if key.startswith(("text_", "vae_"))}
        kept["training_seconds"] = earlier.get("training_seconds")
    return {"text_and_vae": {"from": str(source), **kept}}


# The projections through which a block adds to the residual streams; all zero, the block passes its input on.
_BLOCK_OUTPUTS = {
    "transformer_blocks": ("attn.to_out.0", "attn.to_add_out", "ff.linear_out", "ff_context.linear_out"),
    "single_transformer_blocks": ("attn.to_out",),
}


def grow_transformer(transformer: Flux2Transformer2DModel, smaller: Flux2Transformer2DModel) -> None:
    """Load `smaller`'s weights into `transformer`, which has at least as many blocks of each kind: each
    block keeps its place, and each block `smaller` lacks gets zero output projections, so that
    `transformer` computes what `smaller` does (FLUX.2's modulation is shared by all blocks of a kind:
    no per-block gate to zero) and training grows the new blocks from there."""
    for kind in _BLOCK_OUTPUTS:
        have, want = len(getattr(smaller, kind)), len(getattr(transformer, kind))
        if want < have:
            raise ValueError(f"the transformer to train on from has {have} {kind}; the plan asks for {want}")
    # Strict: every weight of `smaller` must have its place; the new blocks' other weights stay as drawn.
    transformer.load_state_dict({**transformer.state_dict(), **smaller.state_dict()})
    for kind, outputs in _BLOCK_OUTPUTS.items():
        for block in getattr(transformer, kind)[len(getattr(smaller, kind)):]:
            for name in outputs:
                for parameter in block.get_submodule(name).parameters():
                    torch.nn.init.zeros_(parameter)


def _keep_transformer(pipe: Flux2KleinPipeline, source: Path, plan: TrainingPlan) -> dict:
    """Load the transformer saved at `source` into `pipe` to train on from; returns what its
    training_summary.json says of it (its plan and final loss)."""
    loaded = Flux2Transformer2DModel.from_pretrained(source / "transformer")
    if tuple(loaded.config.axes_dims_rope) != plan.axes_dims_rope:
        raise ValueError(f"the transformer at {source} has rope axes {tuple(loaded.config.axes_dims_rope)}, "
                         f"not rope_axes={plan.rope_axes!r}")
    grow_transformer(pipe.transformer, loaded)
    earlier = _training_summary(source)
    steps = earlier.get("plan", {}).get("transformer_steps")
    if steps is not None and "transformer" in earlier:  # `source` itself trained on from another: count those too
        steps += earlier["transformer"].get("steps") or 0
    return {"from": str(source), **{key: value for key, value in earlier.items() if key.startswith("transformer")},
            "steps": steps}


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
