"""Train a style LoRA for the shapes model: `python -m training.shapes.lora --style outline --out FILE.safetensors`.

A PEFT LoRA on the committed pipeline's transformer only (its base weights frozen; the tokenizer,
text encoder and VAE untouched, the VAE's batch-norm statistics included), trained with base
training's own objective and data path (`train.encode_latent_pools`, `train.train_transformer`,
`train.flow_matching_loss`): rectified flow on packed, normalised latents of jittered drawings of
every training scene at every size, now drawn in `--style` (`dataset.render`), each paired with a
fresh training caption (held-out captions and scenes stay held out). The same captions as the base
model, a different drawing: with the LoRA loaded the pipeline draws the scene in that style.

Saved in diffusers' LoRA format (`Flux2KleinPipeline.save_lora_weights`: keys
`transformer.<module>.lora_A.weight` / `.lora_B.weight`, plus the adapter config as metadata), so
`Flux2KleinPipeline.load_lora_weights(FILE)` loads it, hot-swap included. lora_alpha equals the rank:
strength 1.0 is what was trained.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
from diffusers import Flux2KleinPipeline
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict

from acceldemo.models.shapes import trained_model_dir

from .dataset import STYLES
from .train import TrainingPlan, encode_latent_pools, train_transformer

# The linears of the transformer's blocks: attention (image and text streams) and feed-forward of the
# double-stream blocks, the fused attention + MLP projections of the single-stream blocks. Not the
# embedders, the shared modulation or the output layer.
DOUBLE_BLOCK_LINEARS = (
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
    "ff.linear_in", "ff.linear_out", "ff_context.linear_in", "ff_context.linear_out",
)
SINGLE_BLOCK_LINEARS = ("attn.to_qkv_mlp_proj", "attn.to_out")

# Base training's plan with the knobs a LoRA changes (the rest: captions, sizes, text-length cuts,
# noise levels, token weights, as the committed model was trained).
LORA_PLAN = replace(
    TrainingPlan(),
    latent_pool_per_scene=4,
    transformer_steps=1200,
    transformer_learning_rate=2e-3,
    transformer_weight_decay=0.0,
    transformer_shape_weight=12.0,
    warmup_steps=30,
    ema_decay=0.98,
    size_schedule="0,1,2,3,1",
    checkpoint_every=0,
)


def target_modules(transformer: torch.nn.Module) -> list[str]:
    """Full names of the block linears the LoRA adapts (`DOUBLE_BLOCK_LINEARS`, `SINGLE_BLOCK_LINEARS`)."""
    names = []
    blocks = (("transformer_blocks", DOUBLE_BLOCK_LINEARS), ("single_transformer_blocks", SINGLE_BLOCK_LINEARS))
    for kind, linears in blocks:
        for index in range(len(getattr(transformer, kind))):
            names.extend(f"{kind}.{index}.{linear}" for linear in linears)
    return names


def train_lora(style: str, out: Path, plan: TrainingPlan, rank: int, base: Path | None = None) -> dict:
    started = time.monotonic()
    pipe = Flux2KleinPipeline.from_pretrained(base or trained_model_dir())
    pipe.set_progress_bar_config(disable=True)
    for component in (pipe.text_encoder, pipe.vae, pipe.transformer):
        component.requires_grad_(False)
        component.eval()
    targets = target_modules(pipe.transformer)
    torch.manual_seed(plan.seed)  # peft draws lora_A from torch's global generator (lora_B starts at zero)
    pipe.transformer.add_adapter(LoraConfig(r=rank, lora_alpha=rank, init_lora_weights=True, target_modules=targets))
    trainable = sum(p.numel() for p in pipe.transformer.parameters() if p.requires_grad)
    print(f"LoRA rank {rank} on {len(targets)} linears: {trainable} trainable parameters", flush=True)

    pools = encode_latent_pools(pipe, plan, style=style, set_statistics=False)
    encoded = time.monotonic()
    ema, loss = train_transformer(pipe, pools, plan)
    pipe.transformer.load_state_dict(ema)  # the EMA of the adapters (the frozen base weights are unchanged)
    pipe.transformer.eval()

    out.parent.mkdir(parents=True, exist_ok=True)
    Flux2KleinPipeline.save_lora_weights(
        out.parent,
        transformer_lora_layers=get_peft_model_state_dict(pipe.transformer),
        weight_name=out.name,
    )
    summary = {
        "style": style,
        "out": str(out),
        "rank": rank,
        "lora_alpha": rank,
        "target_modules": targets,
        "trainable_parameters": trainable,
        "plan": asdict(plan),
        "transformer_loss_last_200_steps": round(loss, 5),
        "encode_seconds": round(encoded - started, 1),
        "training_seconds": round(time.monotonic() - started, 1),
        "torch_threads": torch.get_num_threads(),
        "file_bytes": out.stat().st_size,
    }
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--style", choices=[style for style in STYLES if style != "filled"], default="outline")
    parser.add_argument("--out", type=Path, required=True, help="the .safetensors file to write")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--steps", type=int, default=LORA_PLAN.transformer_steps)
    parser.add_argument("--learning-rate", type=float, default=LORA_PLAN.transformer_learning_rate)
    parser.add_argument("--pool-per-scene", type=int, default=LORA_PLAN.latent_pool_per_scene,
                        help="jittered drawings of each training scene at each size")
    parser.add_argument("--size-schedule", default=LORA_PLAN.size_schedule)
    parser.add_argument("--seed", type=int, default=LORA_PLAN.seed)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a busy 2-core host)")
    parser.add_argument("--base", type=Path, default=None, help="pipeline folder (default: the committed model)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    plan = replace(LORA_PLAN, transformer_steps=args.steps, transformer_learning_rate=args.learning_rate,
                   latent_pool_per_scene=args.pool_per_scene, size_schedule=args.size_schedule, seed=args.seed)
    summary = train_lora(args.style, args.out, plan, args.rank, args.base)
    print(f"loss (mean of the last 200 steps) {summary['transformer_loss_last_200_steps']}, "
          f"took {summary['training_seconds']} s, {summary['file_bytes']} bytes", flush=True)
    print(json.dumps({key: value for key, value in summary.items() if key != "target_modules"}, indent=2))


if __name__ == "__main__":
    main()
