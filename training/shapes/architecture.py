"""The tiny FLUX.2-klein components of the shapes model: tokenizer, text encoder, VAE, transformer, scheduler.

Everything is built from configs in memory: nothing is downloaded. Head counts are
multiples of 4 so tensor parallelism over 2 or 4 ranks divides them.
"""
from __future__ import annotations

import torch
from diffusers import AutoencoderKLFlux2, Flux2KleinPipeline, Flux2Transformer2DModel
from tokenizers import AddedToken, models, pre_tokenizers
from transformers import Qwen2Tokenizer, Qwen3Config, Qwen3ForCausalLM

from acceldemo.models.shapes.phrasing import CANONICAL_WORD, VOCABULARY
from acceldemo.models.tiny import QWEN3_CHAT_TEMPLATE, flux2_scheduler

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
# Qwen's pre-tokenizer keeps at most one non-letter character in front of a word (" red", "-left",
# ",blue"); each known word gets a token for each of these fronts and each letter case people
# type, and the text encoder gives all of a word's spellings, and its synonyms, one embedding.
WORD_FRONTS = ("", " ", "-", ",", ".", ":", "(", "/")

TEXT_HIDDEN_SIZE = 32
TEXT_OUT_LAYERS = (9, 18, 27)  # the pipeline's default text_encoder_out_layers
MAX_SEQUENCE_LENGTH = 512  # the pipeline's default max_sequence_length
LATENT_CHANNELS = 8
ROPE_AXES = (6, 6, 6, 6)  # the transformer's rotary dims per position axis (t, h, w, l), summing to the head dim
TRANSFORMER_BLOCKS = (3, 6)  # the transformer's double-stream and single-stream block counts


def _byte_level(text: str) -> str:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(text)[0][0]


def word_spellings(word: str) -> list[str]:
    """How `word` reaches the BPE model: each front and letter case, in byte-level symbols."""
    cases = dict.fromkeys((word, word.capitalize(), word.upper()))
    return [_byte_level(front + case) for front in WORD_FRONTS for case in cases]


def _merges_making_single_tokens(pieces: list[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """BPE merges under which every piece is one token, added to `vocab`.

    Each round adds, for every piece still split, the merge of its first two tokens; a new merge
    ranks after all earlier ones, so it cannot split a piece that is already whole.
    """
    merges: list[tuple[str, str]] = []
    while True:
        bpe = models.BPE(vocab=dict(vocab), merges=list(merges))
        new = dict.fromkeys(
            (tokens[0], tokens[1])
            for tokens in ([token.value for token in bpe.tokenize(piece)] for piece in pieces)
            if len(tokens) > 1
        )
        if not new:
            return merges
        for left, right in new:
            vocab.setdefault(left + right, len(vocab))
            merges.append((left, right))


def build_tokenizer() -> Qwen2Tokenizer:
    """A byte-level BPE tokenizer whose merges make every spelling of a known word one token."""
    byte_symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS[:1] + tuple(byte_symbols))}
    pieces = sorted({piece for word in VOCABULARY for piece in word_spellings(word)})
    merges = _merges_making_single_tokens(pieces, vocab)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges)
    tokenizer.add_special_tokens(
        {"additional_special_tokens": [AddedToken(token, special=True) for token in SPECIAL_TOKENS[1:]]}
    )
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    tokenizer.model_max_length = MAX_SEQUENCE_LENGTH
    return tokenizer


def build_text_encoder(tokenizer: Qwen2Tokenizer) -> Qwen3ForCausalLM:
    """A random Qwen3 (`train.train_text_encoder` then teaches it to read captions, embeddings frozen): 28 layers
    so the default out layers (9, 18, 27) exist.

    Token embeddings are drawn at unit scale (instead of 0.02) so that each token's identity
    dominates its hidden states over what 27 random layers add: prompts stay distinguishable.
    Every spelling of a known word, and of its synonyms, shares the embedding of the canonical
    word after a space: letter case, a leading hyphen or comma, "disc" for "circle" change
    nothing, as they would change little for a pretrained encoder (single letters such as "a"
    stay bytes). The transformer then learns word order and what the words mean, not spellings.
    """
    config = Qwen3Config(
        vocab_size=len(tokenizer),
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
    embeddings = model.get_input_embeddings().weight
    with torch.no_grad():
        embeddings.normal_(0.0, 1.0)
        for word in VOCABULARY:
            canonical = tokenizer.convert_tokens_to_ids(_byte_level(" " + CANONICAL_WORD.get(word, word)))
            for spelling in word_spellings(word):
                if len(spelling) > 1:
                    embeddings[tokenizer.convert_tokens_to_ids(spelling)] = embeddings[canonical]
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


def build_transformer(
    axes_dims_rope: tuple[int, ...] = ROPE_AXES, blocks: tuple[int, int] = TRANSFORMER_BLOCKS
) -> Flux2Transformer2DModel:
    """`axes_dims_rope`: rotary dims per position axis (t, h, w, l), summing to the head dim; only h and w
    vary on image tokens, only l on text tokens. `blocks`: (double-stream, single-stream) block counts."""
    return Flux2Transformer2DModel(
        in_channels=4 * LATENT_CHANNELS,
        num_layers=blocks[0],
        num_single_layers=blocks[1],
        attention_head_dim=24,
        num_attention_heads=4,
        joint_attention_dim=len(TEXT_OUT_LAYERS) * TEXT_HIDDEN_SIZE,
        timestep_guidance_channels=64,
        mlp_ratio=3.0,
        axes_dims_rope=axes_dims_rope,
        guidance_embeds=False,
    )


def build_pipeline(
    seed: int, axes_dims_rope: tuple[int, ...] = ROPE_AXES, blocks: tuple[int, int] = TRANSFORMER_BLOCKS
) -> Flux2KleinPipeline:
    """All components with fresh weights drawn from `seed`."""
    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    return Flux2KleinPipeline(
        scheduler=flux2_scheduler(),
        vae=build_vae(),
        text_encoder=build_text_encoder(tokenizer),
        tokenizer=tokenizer,
        transformer=build_transformer(axes_dims_rope, blocks),
        is_distilled=True,
    )
