"""Tiny random-weight pipelines of the four demo families, built offline and deterministically."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from diffusers import (
    AutoencoderKL,
    AutoencoderKLFlux2,
    DiffusionPipeline,
    FlowMatchEulerDiscreteScheduler,
    Flux2KleinPipeline,
    Flux2Pipeline,
    Flux2Transformer2DModel,
    FluxPipeline,
    FluxTransformer2DModel,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
)
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    Mistral3Config,
    Mistral3ForConditionalGeneration,
    MistralConfig,
    PixtralVisionConfig,
    PreTrainedTokenizerFast,
    Qwen2Tokenizer,
    Qwen3Config,
    Qwen3ForCausalLM,
    T5Config,
    T5EncoderModel,
    T5Tokenizer,
)

# Part of the saved folder name: bump it whenever a config below changes, so that
# folders built by an older version are never mistaken for the current model.
TINY_BUILD_VERSION = "1"

_SEED = 0
# Every transformer and text encoder has 4 heads (and 4 KV heads) so that tensor
# parallelism over 2 or 4 ranks splits them evenly.
_HEADS = 4
_HEAD_DIM = 16
_VAE_LATENT_CHANNELS = 4
# Shared by the FLUX.1/SD3 and FLUX.2 autoencoders. Four levels give the real 8x spatial
# compression, so the valid image sizes are those of the real models.
_VAE_LAYOUT = dict(
    block_out_channels=(8, 8, 8, 8),
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    layers_per_block=1,
    latent_channels=_VAE_LATENT_CHANNELS,
    norm_num_groups=4,
    # Attention at the latent resolution is quadratic in pixels: at 512 px it would
    # dominate the run time of a model this small.
    mid_block_add_attention=False,
)
# Text encoders of the decoder-LLM kind (Qwen3, Mistral) are deep because the pipelines
# read fixed hidden-state layers out of them; a width of 16 keeps them tiny anyway.
_LLM_HIDDEN = 16
_CLIP_MAX_LENGTH = 77

# Byte-level alphabet: every string maps onto these 256 symbols, so any prompt tokenizes
# without a learned vocabulary. Sorted because the library returns it in set order.
_BYTE_ALPHABET = sorted(pre_tokenizers.ByteLevel.alphabet())

# Qwen3's own template, cut down to what Flux2KleinPipeline sends: plain-text messages,
# a generation prompt, and the empty think block that enable_thinking=False asks for.
QWEN3_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)

# Mistral's instruct format as Flux2Pipeline sends it: content is a list of typed parts.
_MISTRAL_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['content'] is string %}{% set text = message['content'] %}"
    "{% else %}{% set text = message['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('') %}{% endif %}"
    "{% if message['role'] == 'system' %}[SYSTEM_PROMPT]{{ text }}[/SYSTEM_PROMPT]"
    "{% elif message['role'] == 'user' %}[INST]{{ text }}[/INST]"
    "{% else %}{{ text }}{{ eos_token }}{% endif %}"
    "{% endfor %}"
)


def _padded_vocab_size(num_tokens: int) -> int:
    """Embedding rows for a vocabulary: a multiple of 4, as TP shards the LM head by rows."""
    return -(-num_tokens // 4) * 4


def _vocab(tokens: list[str]) -> dict[str, int]:
    return {token: i for i, token in enumerate(tokens)}


def _clip_tokenizer() -> CLIPTokenizer:
    # CLIP's BPE marks the last symbol of each word with "</w>": both forms are needed.
    end_of_word = [symbol + "</w>" for symbol in _BYTE_ALPHABET]
    vocab = _vocab(["<|startoftext|>", "<|endoftext|>", *_BYTE_ALPHABET, *end_of_word])
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=_CLIP_MAX_LENGTH)


def _t5_tokenizer() -> T5Tokenizer:
    # Unigram over single printable ASCII characters; anything else becomes <unk>.
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [(chr(c), -3.0) for c in range(33, 127)]
    return T5Tokenizer(vocab=pieces, extra_ids=0)


def _qwen2_tokenizer() -> Qwen2Tokenizer:
    # Like Qwen3's own vocabulary, the chat markers and think tags are single tokens.
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    return Qwen2Tokenizer(
        vocab=_vocab([*specials, *_BYTE_ALPHABET]),
        merges=[],
        additional_special_tokens=specials[1:],
        chat_template=QWEN3_CHAT_TEMPLATE,
    )


def _mistral_tokenizer() -> PreTrainedTokenizerFast:
    # Flux2Pipeline only needs apply_chat_template from its processor; PixtralProcessor
    # would also pull in torchvision, which cannot be installed beside the CPU torch.
    specials = ["<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"]
    backend = Tokenizer(models.BPE(vocab=_vocab([*specials, *_BYTE_ALPHABET]), merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        additional_special_tokens=specials[4:],
        chat_template=_MISTRAL_CHAT_TEMPLATE,
    )


def _clip_text_encoder(
    tokenizer: CLIPTokenizer, hidden_size: int, with_projection: bool
) -> CLIPTextModel | CLIPTextModelWithProjection:
    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        projection_dim=hidden_size,
        num_hidden_layers=2,
        num_attention_heads=_HEADS,
        max_position_embeddings=_CLIP_MAX_LENGTH,
        hidden_act="gelu",
        # The pooled output is read at the first EOS, so the ids must match the tokenizer.
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return (CLIPTextModelWithProjection if with_projection else CLIPTextModel)(config)


def _t5_encoder(tokenizer: T5Tokenizer, d_model: int) -> T5EncoderModel:
    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=d_model,
        d_kv=d_model // _HEADS,
        d_ff=2 * d_model,
        num_layers=2,
        num_heads=_HEADS,
        feed_forward_proj="gated-gelu",
        dropout_rate=0.0,
        is_encoder_decoder=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return T5EncoderModel(config)


def _llm_text_config(
    config_class: type[Qwen3Config | MistralConfig], tokenizer: PreTrainedTokenizerFast, num_layers: int
) -> Qwen3Config | MistralConfig:
    """Decoder-LLM text config shared by Qwen3 and Mistral (their fields coincide)."""
    return config_class(
        vocab_size=_padded_vocab_size(len(tokenizer)),
        hidden_size=_LLM_HIDDEN,
        intermediate_size=2 * _LLM_HIDDEN,
        num_hidden_layers=num_layers,
        num_attention_heads=_HEADS,
        num_key_value_heads=_HEADS,
        head_dim=_LLM_HIDDEN // _HEADS,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


# The FLUX transformers' blocks: two double-stream and two single-stream, on latents whose 2x2 pixels are packed into
# channels (by the VAE for FLUX.2, by the pipeline for FLUX.1).
_FLUX_BLOCKS = {"patch_size": 1, "in_channels": 4 * _VAE_LATENT_CHANNELS, "num_layers": 2, "num_single_layers": 2,
                "attention_head_dim": _HEAD_DIM, "num_attention_heads": _HEADS}


def _flux2_transformer(joint_attention_dim: int, guidance_embeds: bool) -> Flux2Transformer2DModel:
    return Flux2Transformer2DModel(
        **_FLUX_BLOCKS,
        joint_attention_dim=joint_attention_dim,
        timestep_guidance_channels=32,
        axes_dims_rope=(4, 4, 4, 4),
        guidance_embeds=guidance_embeds,
    )


def flux2_scheduler() -> FlowMatchEulerDiscreteScheduler:
    """FLUX.2's own scheduler config (shared by the trained shapes model): the pipelines pass an image-size dependent
    mu."""
    return FlowMatchEulerDiscreteScheduler(
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
        time_shift_type="exponential",
    )


def _build_flux2_klein() -> Flux2KleinPipeline:
    tokenizer = _qwen2_tokenizer()
    # 27 layers: the pipeline stacks hidden states 9, 18 and 27 by default.
    text_encoder = Qwen3ForCausalLM(_llm_text_config(Qwen3Config, tokenizer, num_layers=27))
    return Flux2KleinPipeline(
        scheduler=flux2_scheduler(),
        vae=AutoencoderKLFlux2(**_VAE_LAYOUT),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=_flux2_transformer(joint_attention_dim=3 * _LLM_HIDDEN, guidance_embeds=False),
        is_distilled=True,
    )


def _build_flux2() -> Flux2Pipeline:
    tokenizer = _mistral_tokenizer()
    # 31 layers: the pipeline stacks hidden states 10, 20 and 30 by default.
    text_config = _llm_text_config(MistralConfig, tokenizer, num_layers=31)
    vision_config = PixtralVisionConfig(
        hidden_size=_LLM_HIDDEN,
        intermediate_size=2 * _LLM_HIDDEN,
        num_hidden_layers=1,
        num_attention_heads=_HEADS,
        image_size=32,
        patch_size=16,
    )
    text_encoder = Mistral3ForConditionalGeneration(
        Mistral3Config(text_config=text_config, vision_config=vision_config, tie_word_embeddings=True)
    )
    return Flux2Pipeline(
        scheduler=flux2_scheduler(),
        vae=AutoencoderKLFlux2(**_VAE_LAYOUT),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=_flux2_transformer(joint_attention_dim=3 * _LLM_HIDDEN, guidance_embeds=True),
    )


def _build_flux1() -> FluxPipeline:
    clip_hidden, t5_hidden = 32, 32
    tokenizer, tokenizer_2 = _clip_tokenizer(), _t5_tokenizer()
    transformer = FluxTransformer2DModel(
        **_FLUX_BLOCKS,
        joint_attention_dim=t5_hidden,
        pooled_projection_dim=clip_hidden,
        # Like FLUX.1-schnell: timestep-distilled, no guidance embedding.
        guidance_embeds=False,
        axes_dims_rope=(4, 6, 6),
    )
    return FluxPipeline(
        # FLUX.1-schnell's scheduler: fixed shift, no resolution-dependent shifting.
        scheduler=FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=False),
        vae=AutoencoderKL(**_VAE_LAYOUT, scaling_factor=0.3611, shift_factor=0.1159),
        text_encoder=_clip_text_encoder(tokenizer, clip_hidden, with_projection=False),
        tokenizer=tokenizer,
        text_encoder_2=_t5_encoder(tokenizer_2, t5_hidden),
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )


def _build_sd3() -> StableDiffusion3Pipeline:
    clip_hidden, clip_2_hidden = 16, 32
    # The CLIP embeddings are zero-padded up to the T5 width, which must therefore hold both.
    t5_hidden = 64
    tokenizer, tokenizer_2, tokenizer_3 = _clip_tokenizer(), _clip_tokenizer(), _t5_tokenizer()
    patch_size = 2
    transformer = SD3Transformer2DModel(
        sample_size=32,
        patch_size=patch_size,
        in_channels=_VAE_LATENT_CHANNELS,
        out_channels=_VAE_LATENT_CHANNELS,
        num_layers=2,
        attention_head_dim=_HEAD_DIM,
        num_attention_heads=_HEADS,
        joint_attention_dim=t5_hidden,
        caption_projection_dim=_HEADS * _HEAD_DIM,
        pooled_projection_dim=clip_hidden + clip_2_hidden,
        # Positions are cropped from a square table: 512 px / VAE 8 / patch 2.
        pos_embed_max_size=512 // 8 // patch_size,
        # Like SD3.5-medium: RMS-normed q/k and a dual-attention (MMDiT-X) first block.
        qk_norm="rms_norm",
        dual_attention_layers=(0,),
    )
    return StableDiffusion3Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=AutoencoderKL(**_VAE_LAYOUT, scaling_factor=1.5305, shift_factor=0.0609),
        text_encoder=_clip_text_encoder(tokenizer, clip_hidden, with_projection=True),
        tokenizer=tokenizer,
        text_encoder_2=_clip_text_encoder(tokenizer_2, clip_2_hidden, with_projection=True),
        tokenizer_2=tokenizer_2,
        text_encoder_3=_t5_encoder(tokenizer_3, t5_hidden),
        tokenizer_3=tokenizer_3,
        transformer=transformer,
    )


_BUILDERS: dict[str, Callable[[], DiffusionPipeline]] = {
    "flux2-klein": _build_flux2_klein,
    "flux1": _build_flux1,
    "sd3": _build_sd3,
    "flux2": _build_flux2,
}
TINY_FAMILIES = tuple(_BUILDERS)


def _builder(family: str) -> Callable[[], DiffusionPipeline]:
    try:
        return _BUILDERS[family]
    except KeyError:
        raise ValueError(f"unknown tiny model family {family!r}; known: {', '.join(TINY_FAMILIES)}") from None


def build_tiny_pipeline(family: str) -> DiffusionPipeline:
    """Build the tiny pipeline of `family` in memory; the same call gives the same weights.

    Weights are in torch's default dtype (float32 unless a caller changed it).
    """
    builder = _builder(family)
    # A private RNG stream: fixed weights, and the caller's global RNG state is left alone.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED)
        pipeline = builder()
    # Modules built from a config start in training mode; from_pretrained returns them in
    # eval mode, and a built pipeline must behave like a loaded one.
    for component in pipeline.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval()
    return pipeline


def ensure_tiny_model(family: str, root: Path) -> Path:
    """Return the saved tiny model of `family` under `root`, building and saving it on first use.

    The folder appears atomically: it is written beside its final place and renamed
    into it, so a crashed or concurrent builder never leaves a half-written model
    where a loader would find it.
    """
    _builder(family)  # an unknown family fails before anything touches the disk
    root = Path(root)
    folder = root / f"tiny-{family}-v{TINY_BUILD_VERSION}"
    if folder.is_dir():
        return folder
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".partial", dir=root))
    # mkdtemp makes the folder private; the model is meant to be readable like any download.
    staging.chmod(0o755)
    try:
        build_tiny_pipeline(family).save_pretrained(staging)
        try:
            os.rename(staging, folder)
        except OSError:
            # Another builder renamed its copy in first; theirs is complete, use it.
            if not folder.is_dir():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder
