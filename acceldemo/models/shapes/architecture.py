"""The tiny FLUX.2-klein components of the shapes model: tokenizer, text encoder, VAE, transformer, scheduler.

Everything is built from configs in memory: nothing is downloaded. Head counts are
multiples of 4 so tensor parallelism over 2 or 4 ranks divides them.
"""
from __future__ import annotations

import torch
from diffusers import AutoencoderKLFlux2, Flux2KleinPipeline, Flux2Transformer2DModel
from tokenizers import AddedToken, pre_tokenizers
from transformers import Qwen2Tokenizer, Qwen3Config, Qwen3ForCausalLM

from ..tiny import QWEN3_CHAT_TEMPLATE, flux2_scheduler
from .dataset import COLOURS, POSITIONS, SHAPES

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
# Words that become single tokens when they follow a space; any other text falls back to bytes.
WORDS = sorted(
    set(COLOURS)
    | set(SHAPES)
    | {word for position in POSITIONS for word in position.split()}
    | {"on", "background", "a", "an", "the", "in", "of", "image", "photo", "picture"}
)

TEXT_HIDDEN_SIZE = 32
TEXT_OUT_LAYERS = (9, 18, 27)  # the pipeline's default text_encoder_out_layers
MAX_SEQUENCE_LENGTH = 512  # the pipeline's default max_sequence_length
LATENT_CHANNELS = 8


def build_tokenizer() -> Qwen2Tokenizer:
    """A byte-level BPE tokenizer whose only merges spell the caption words (after a space)."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    byte_symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS[:1] + tuple(byte_symbols))}
    merges: list[tuple[str, str]] = []
    space = byte_level.pre_tokenize_str(" ")[0][0]
    for word in WORDS:
        piece = space
        for letter in word:
            if piece + letter not in vocab:
                vocab[piece + letter] = len(vocab)
                merges.append((piece, letter))
            piece += letter
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges)
    tokenizer.add_special_tokens(
        {"additional_special_tokens": [AddedToken(token, special=True) for token in SPECIAL_TOKENS[1:]]}
    )
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    tokenizer.model_max_length = MAX_SEQUENCE_LENGTH
    return tokenizer


def build_text_encoder(vocab_size: int) -> Qwen3ForCausalLM:
    """A random, frozen Qwen3: 28 layers so the default out layers (9, 18, 27) exist.

    Token embeddings are drawn at unit scale (instead of 0.02) so that each token's identity
    dominates its hidden states over what 27 random layers add: prompts stay distinguishable.
    """
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=TEXT_HIDDEN_SIZE,
        intermediate_size=2 * TEXT_HIDDEN_SIZE,
        num_hidden_layers=28,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=TEXT_HIDDEN_SIZE // 4,
        max_position_embeddings=2 * MAX_SEQUENCE_LENGTH,
        tie_word_embeddings=True,
    )
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_(0.0, 1.0)
    return model


def build_vae() -> AutoencoderKLFlux2:
    """A 4× downsampling VAE (3 levels; FLUX.2's has 4 and 8×): at 8× this size it could not learn
    to draw the shapes' colours within the training budget, at 4× it does in a few minutes.
    """
    levels = 3
    return AutoencoderKLFlux2(
        down_block_types=("DownEncoderBlock2D",) * levels,
        up_block_types=("UpDecoderBlock2D",) * levels,
        block_out_channels=(8, 16, 32),
        layers_per_block=1,
        latent_channels=LATENT_CHANNELS,
        norm_num_groups=4,
        sample_size=64,
        mid_block_add_attention=False,
    )


def build_transformer() -> Flux2Transformer2DModel:
    return Flux2Transformer2DModel(
        in_channels=4 * LATENT_CHANNELS,
        num_layers=2,
        num_single_layers=4,
        attention_head_dim=24,
        num_attention_heads=4,
        joint_attention_dim=len(TEXT_OUT_LAYERS) * TEXT_HIDDEN_SIZE,
        timestep_guidance_channels=64,
        mlp_ratio=3.0,
        axes_dims_rope=(6, 6, 6, 6),
        guidance_embeds=False,
    )


def build_pipeline(seed: int) -> Flux2KleinPipeline:
    """All components with fresh weights drawn from `seed`."""
    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    return Flux2KleinPipeline(
        scheduler=flux2_scheduler(),
        vae=build_vae(),
        text_encoder=build_text_encoder(vocab_size=len(tokenizer)),
        tokenizer=tokenizer,
        transformer=build_transformer(),
        is_distilled=True,
    )
