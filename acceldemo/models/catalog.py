"""The models the demo offers: pipeline class, recipe defaults, valid shapes, sizes and what can be sharded."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import UnknownName
from ..records import EditMethod, GraphRule, Quantization, Shape
from . import real_configs
from .caches import (
    FAMILY_REFUSALS,
    FIRST_BLOCK_FLUX1,
    MAG_FLUX1,
    PAB_FLUX,
    QUANTIZED_PREFIXES,
    TECHNIQUES,
    CacheAdvice,
    CachePreset,
    StepCache,
    taylorseer,
)
from .families import PipelineFamily
from .shapes import RECOMMENDED_MAX_SEQUENCE_LENGTH as SHAPES_MAX_SEQUENCE_LENGTH
from .shapes import SIZES as SHAPES_SIZES
from .shapes import phrasing as shapes_phrasing
from .weights import DTYPE_BYTES

GB = 1000**3
# OpenAI's quality names and the model preset each takes: gpt-image's low/medium/high (xhigh and max: the highest
# a model has), DALL-E 3's standard and hd; "auto" is the model's default steps.
QUALITY_PRESETS = {"low": "low", "medium": "medium", "standard": "medium", "high": "high", "hd": "high",
                   "xhigh": "high", "max": "high"}
QUALITIES = ("auto", *QUALITY_PRESETS)
# The unknown words a note names before it says "and N more".
NOTE_WORDS = 12


@dataclass(frozen=True)
class ModelSpec:
    """Everything the app knows about one model; nothing about hardware or the UI."""

    name: str
    title: str
    family: PipelineFamily
    repo: str | None  # Hugging Face repo id; None for the embedded tiny models
    tiny_family: str | None = None  # the embedded builder that makes it (acceldemo.models.tiny)
    bundled: bool = False  # weights committed with the project (acceldemo/models/shapes/weights)
    dtype: str = "bfloat16"
    steps: int = 4
    guidance: float = 0.0
    default_shape: Shape = Shape(1024, 1024)
    presets: tuple[Shape, ...] = (Shape(1024, 1024),)
    # True for a model that draws right at a few sizes only: it is served at its presets, any other size refused.
    only_presets: bool = False
    granularity: int = 16
    min_side: int = 256
    max_side: int = 2048
    max_steps: int = 100
    # Packed-latent transformers see only the token count, so WxH and HxW share a graph.
    packed_latents: bool = True
    # Guidance above this turns classifier-free guidance on, which doubles the transformer batch.
    cfg_above: float | None = None
    max_sequence_length: int | None = None
    repeated_blocks: bool = True
    # Bytes of weights per component in `dtype`; the placement proposal reads these.
    component_bytes: dict[str, int] = field(default_factory=dict)
    # Requests one pipeline call may draw together (each still its own image): batching pays for small models and
    # shapes, hardly at all for a large model at 1024² (≈1.02x), while it costs memory. The engine also keeps a
    # batch within the device's memory left beside the weights, at `activation_bytes` per image and megapixel.
    max_batch: int = 4
    activation_bytes: int = 0
    # Components that have a tensor-parallel plan (diffusers `_tp_plan`, transformers `tp_plan="auto"`).
    tp_components: tuple[str, ...] = ()
    # Whether diffusers can spread its transformer's tokens over ranks (the transformer class has a `_cp_plan`).
    context_parallel: bool = False
    # (query heads, key/value heads) of each component a tensor-parallel degree shards: it must divide them all.
    shard_heads: dict[str, tuple[int, int]] = field(default_factory=dict)
    description: str = ""
    # Prompts that show what the model can do, offered beside the prompt box.
    example_prompts: tuple[str, ...] = ()
    # The words the model was trained on (empty: any prompt goes, nothing is checked) and a sentence that names them
    # for a person (what a "does not know" note ends with).
    vocabulary: tuple[str, ...] = ()
    vocabulary_summary: str = ""
    # Denoise steps per quality preset (low, medium, high), what OpenAI's `quality` asks for.
    quality_steps: dict[str, int] = field(default_factory=lambda: {"low": 2, "medium": 4, "high": 8})
    # Whether its VAE decodes an alpha channel (OpenAI's background "transparent"); none of these does.
    alpha: bool = False
    # How it edits a picture: "strength" (image-to-image: the picture noised to the strength's sigma, the rest
    # denoised) or "reference" (FLUX.2: reference images the transformer attends to); and whether it repaints only
    # a masked region (inpainting: diffusers' inpainting pipeline of its family — FluxInpaintPipeline,
    # StableDiffusion3InpaintPipeline, Flux2KleinInpaintPipeline — or, for the embedded tiny-shapes, this project's
    # own strength path; FLUX.2 [dev] has none).
    edits: EditMethod = EditMethod.STRENGTH
    inpaints: bool = False
    # Reference pictures one edit may give ("reference" models).
    max_references: int = 1
    # The step caches it offers, each with its preset and why (the others are refused: `cache_refusal`), and
    # what `auto` picks.
    step_caches: dict[StepCache, CachePreset] = field(default_factory=dict)
    cache_advice: CacheAdvice = CacheAdvice(None, why="no cache recommended")

    def __repr__(self) -> str:
        return f"ModelSpec({self.name!r})"

    @property
    def attention_heads(self) -> int:
        """The transformer's attention heads (0: none known)."""
        return self.shard_heads.get("transformer", (0, 0))[0]

    def shard_divisors(self) -> list[tuple[str, int]]:
        """Every head count a tensor-parallel degree must divide, named: ("transformer attention heads", 24), ..."""
        named = []
        for component in self.tp_components:
            heads, kv_heads = self.shard_heads.get(component, (0, 0))
            words = component.replace("_", " ")
            named += [(f"{words} attention heads", heads)] if heads else []
            named += [(f"{words} key/value heads", kv_heads)] if kv_heads and kv_heads != heads else []
        return named

    @property
    def weight_bytes(self) -> int:
        return sum(self.component_bytes.values())

    def steps_for(self, quality: str) -> int:
        """The steps of an OpenAI quality name (one of QUALITIES): its preset, or the model's default for auto."""
        return self.steps if quality == "auto" else self.quality_steps[QUALITY_PRESETS[quality]]

    def unknown_words(self, prompt: str) -> tuple[str, ...]:
        """Words of `prompt` outside the model's vocabulary, lower-cased, in prompt order, each once."""
        if not self.vocabulary:
            return ()
        known = set(self.vocabulary)
        # Split as the vocabulary itself was: case-folded runs of letters or digits.
        return tuple(dict.fromkeys(word for word in shapes_phrasing.words(prompt) if word not in known))

    def prompt_note(self, prompt: str) -> str:
        """What to tell a person whose prompt has words the model does not know; "" when it knows them all."""
        unknown = self.unknown_words(prompt)
        if not unknown:
            return ""
        named = ", ".join(unknown[:NOTE_WORDS]) + (f" and {len(unknown) - NOTE_WORDS} more" if len(unknown) > NOTE_WORDS
                                                   else "")
        return f"{self.name} does not know: {named} — it knows {self.vocabulary_summary}"

    @property
    def graph_rule(self) -> GraphRule:
        """What of this model decides when a compiled graph is reused: what its requests carry."""
        return GraphRule(self.granularity, self.packed_latents, self.cfg_above, self.max_sequence_length,
                         self.edits == EditMethod.REFERENCE)

    def image_tokens(self, shape: Shape, references: int = 0) -> int:
        return self.graph_rule.image_tokens(shape, references)

    def graph_key(self, shape: Shape, num_images: int, guidance: float, references: int = 0) -> tuple:
        return self.graph_rule.key(shape, num_images, guidance, references)


# TaylorSeer as measured here on tiny-shapes at 128x128 (bench section acceleration): two computed steps to start
# the series, then one in three; 2.2x at 28 steps with a mean change of 0.05/255 and the judge's accuracy unchanged.
_TAYLORSEER_TINY = taylorseer(3, 2, "two computed steps start the series, then one step in three is computed: "
                                    "measured on tiny-shapes (bench section acceleration)")
# diffusers' documented TaylorSeer example for FLUX.1-dev (28-50 steps), with bf16 factors (its default).
_TAYLORSEER_LONG = taylorseer(5, 3, "diffusers' documented setting for FLUX.1-dev: three computed steps, then one in "
                                    "five", factors="bfloat16")
# At 4 steps a cache computes 3 of 4 steps at best (1.2x here), on the steps a distilled model changes most.
_FEW_STEPS = "at its 4 steps a cache saves at most one transformer call in four (1.2x measured on tiny-shapes)"
_ADVICE_TINY = CacheAdvice(StepCache.TAYLORSEER, 8, f"TaylorSeer from 8 steps on; below, none: {_FEW_STEPS}")
_FLUX1_CACHES = {preset.cache: preset for preset in (_TAYLORSEER_TINY, FIRST_BLOCK_FLUX1, MAG_FLUX1, PAB_FLUX)}
_FLUX2_CACHES = {preset.cache: preset for preset in (_TAYLORSEER_TINY, PAB_FLUX)}

# The embedded models' transformers and LLM text encoders: 4 heads, 4 key/value heads (acceldemo.models.tiny).
_TINY_HEADS = {"transformer": (4, 4), "text_encoder": (4, 4)}


def _real(name: str, dtype: str = "bfloat16") -> dict:
    """A real model's figures derived from its configs in the repository (models/configs/<name>/): weight bytes per
    component (stored values × the dtype's size) and the heads of every component, never typed twice."""
    return {"component_bytes": real_configs.component_bytes(name, dtype),
            "shard_heads": {component: real_configs.attention_heads(name, component)
                            for component in real_configs.components(name) if component != "vae"}}


# The FLUX family's transformers (FLUX.1, FLUX.2, klein) have a context-parallel plan in diffusers 0.42.1; SD3's not.
_CP = dict(context_parallel=True)
_TINY = dict(cache_advice=_ADVICE_TINY, dtype="float32", min_side=64, max_side=512, default_shape=Shape(64, 64),
             activation_bytes=200_000_000,
             presets=(Shape(64, 64), Shape(128, 128), Shape(128, 64), Shape(256, 256)),
             component_bytes={"transformer": 2_000_000, "text_encoder": 2_000_000, "vae": 1_000_000})

CATALOG: dict[str, ModelSpec] = {spec.name: spec for spec in (
    ModelSpec(
        **_CP, name="tiny-shapes", title="Tiny shapes (embedded, trained: coloured shapes on a background)",
        family=PipelineFamily.FLUX2_KLEIN, repo=None, bundled=True, steps=4, guidance=1.0, inpaints=True,
        step_caches=_FLUX2_CACHES,
        max_sequence_length=SHAPES_MAX_SEQUENCE_LENGTH, tp_components=("transformer", "text_encoder"),
        shard_heads=_TINY_HEADS,
        description="A FLUX.2-klein-family model trained here to draw one coloured shape on a background at "
                    f"{', '.join(str(Shape(*size)) for size in SHAPES_SIZES)}, from captions such as "
                    "'a red circle on a blue background, top left', 'green disc, upper right' or 'a square'. "
                    "See acceldemo/models/shapes/MODEL_CARD.md.",
        example_prompts=shapes_phrasing.EXAMPLE_PROMPTS, vocabulary=shapes_phrasing.VOCABULARY,
        vocabulary_summary=shapes_phrasing.KNOWN_WORDS_SUMMARY,
        **{**_TINY, "default_shape": Shape(*SHAPES_SIZES[0]), "presets": tuple(Shape(*size) for size in SHAPES_SIZES),
           "only_presets": True}),
    ModelSpec(
        **_CP, name="tiny-flux2-klein", title="Tiny FLUX.2-klein (embedded, random weights)",
        family=PipelineFamily.FLUX2_KLEIN, repo=None, tiny_family="flux2-klein", steps=4, guidance=1.0,
        step_caches=_FLUX2_CACHES,
        edits=EditMethod.REFERENCE, max_references=4, inpaints=True,
        max_sequence_length=64, tp_components=("transformer", "text_encoder"), shard_heads=_TINY_HEADS,
        description="Built offline by the project; exercises every mode, the shape cache and the pool.", **_TINY),
    ModelSpec(
        **_CP, name="tiny-flux1", title="Tiny FLUX.1 (embedded, random weights)", family=PipelineFamily.FLUX1,
        repo=None, tiny_family="flux1", inpaints=True, steps=4, guidance=0.0, max_sequence_length=64,
        step_caches=_FLUX1_CACHES,
        tp_components=("transformer",), shard_heads=_TINY_HEADS, **_TINY),
    ModelSpec(
        name="tiny-sd3", title="Tiny SD3 (embedded, random weights)", family=PipelineFamily.SD3,
        repo=None, tiny_family="sd3", steps=4, guidance=4.5, cfg_above=1.0, packed_latents=False,
        max_sequence_length=64, repeated_blocks=False, step_caches={StepCache.TAYLORSEER: _TAYLORSEER_TINY},
        # No mask: diffusers' SD3 inpainting pipeline wants 16 latent channels (SD 3.5's); the tiny VAE has 4.
        **_TINY),
    ModelSpec(
        **_CP, name="tiny-flux2", title="Tiny FLUX.2 (embedded, random weights)", family=PipelineFamily.FLUX2,
        repo=None, tiny_family="flux2", steps=4, guidance=4.0, max_sequence_length=256, step_caches=_FLUX2_CACHES,
        edits=EditMethod.REFERENCE, max_references=4,
        tp_components=("transformer", "text_encoder"), shard_heads=_TINY_HEADS, **_TINY),
    ModelSpec(
        **_CP, name="flux2-klein-4b", title="FLUX.2 [klein] 4B", family=PipelineFamily.FLUX2_KLEIN,
        repo="black-forest-labs/FLUX.2-klein-4B", inpaints=True, steps=4, guidance=1.0, step_caches=_FLUX2_CACHES,
        cache_advice=CacheAdvice(StepCache.TAYLORSEER, 8, f"TaylorSeer from 8 steps on; at the recipe's 4: none, "
                                                          f"{_FEW_STEPS}"),
        edits=EditMethod.REFERENCE, max_references=4,
        presets=(Shape(1024, 1024), Shape(768, 768), Shape(1024, 768), Shape(768, 1024), Shape(512, 512)),
        **_real("flux2-klein-4b"), tp_components=("transformer", "text_encoder"), max_batch=4,
        activation_bytes=3 * GB,
        description="Fits one NeuronCore: the whole pipeline on the device."),
    ModelSpec(
        **_CP, name="flux1-schnell", title="FLUX.1 [schnell]", family=PipelineFamily.FLUX1,
        repo="black-forest-labs/FLUX.1-schnell", inpaints=True, steps=4, guidance=0.0, step_caches=_FLUX1_CACHES,
        cache_advice=CacheAdvice(StepCache.TAYLORSEER, 8, f"TaylorSeer from 8 steps on; at the recipe's 4: none, "
                                                          f"{_FEW_STEPS}"),
        presets=(Shape(1024, 1024), Shape(768, 768), Shape(1024, 768), Shape(768, 1024), Shape(512, 512)),
        **_real("flux1-schnell"), tp_components=("transformer",), max_batch=2, activation_bytes=4 * GB,
        description="Does not fit one v6e chip: model CPU offload."),
    ModelSpec(
        name="sd3.5-medium", title="Stable Diffusion 3.5 Medium", family=PipelineFamily.SD3,
        repo="stabilityai/stable-diffusion-3.5-medium", inpaints=True, steps=40, guidance=4.5, cfg_above=1.0,
        step_caches={StepCache.TAYLORSEER: _TAYLORSEER_LONG},
        cache_advice=CacheAdvice(StepCache.TAYLORSEER, 12, "TaylorSeer from 12 steps on: at the recipe's 40 the "
                                                            "peers' caches buy 1.5-2.7x (cache-dit, vLLM-Omni)"),
        packed_latents=False, max_side=1440, repeated_blocks=False, max_batch=2, activation_bytes=4 * GB,
        quality_steps={"low": 20, "medium": 28, "high": 40},
        presets=(Shape(1024, 1024), Shape(768, 768), Shape(1024, 768), Shape(768, 1024), Shape(512, 512)),
        **_real("sd3.5-medium"),
        description="About 16 GB in bf16: fits one v6e chip; compile the full transformer."),
    ModelSpec(
        **_CP, name="flux2-dev", title="FLUX.2 [dev]", family=PipelineFamily.FLUX2,
        repo="black-forest-labs/FLUX.2-dev", steps=28, guidance=4.0,
        step_caches={StepCache.TAYLORSEER: _TAYLORSEER_LONG, StepCache.PAB: PAB_FLUX},
        cache_advice=CacheAdvice(StepCache.TAYLORSEER, 12, "TaylorSeer from 12 steps on: at the recipe's 28 SGLang "
                                                            "reports FLUX.2-dev 45 s -> 24 s with a step cache"),
        edits=EditMethod.REFERENCE, max_references=4,
        quality_steps={"low": 16, "medium": 28, "high": 50},
        presets=(Shape(1024, 1024), Shape(768, 768), Shape(1024, 768), Shape(768, 1024)),
        **_real("flux2-dev"), tp_components=("transformer", "text_encoder"), max_batch=1, activation_bytes=8 * GB,
        description="Text encoder (~47 GB) and transformer (~64 GB) each exceed one chip: tensor parallel."),
)}

def get_model(name: object) -> ModelSpec:
    """The catalog entry called `name`; unknown names are answered with the known ones."""
    try:
        return CATALOG[name]  # type: ignore[index]
    except (KeyError, TypeError):
        raise UnknownName("model", name, CATALOG) from None


# --- what a model offers of the step caches and quantized weights (`caches`) ---------------------------------

def cache_refusal(spec: ModelSpec, cache: StepCache) -> str | None:
    """Why the model cannot run this cache (None: it offers a preset for it)."""
    if cache in spec.step_caches:
        return None
    family = FAMILY_REFUSALS.get((spec.family, cache))
    if family:
        return family
    if cache is StepCache.MAG:
        return (f"no calibrated magnitude ratios for {spec.name}: MagCache skips by them, and diffusers ships FLUX.1's "
                "only (MagCacheConfig(calibrate=True) measures a model's)")
    return f"{spec.name} states no preset for it"


def step_cache_views(spec: ModelSpec) -> tuple[dict, ...]:
    """Every step cache as the model offers it (its preset; `eager_only` where diffusers' hooks sit inside the
    transformer) or with why it is refused."""
    views = []
    for cache in StepCache:
        refused = cache_refusal(spec, cache)
        views.append({"name": str(cache), "title": TECHNIQUES[cache].title, "refused": refused} if refused else
                     {**spec.step_caches[cache].describe(), "eager_only": not cache.decides_per_call,
                      "refused": None})
    return tuple(views)


def component_bytes_at(spec: ModelSpec, quantization: Quantization) -> dict[str, int]:
    """The model's weight bytes per component when its transformer and text encoders are quantized."""
    per = quantization.bytes_per_weight
    if per is None:
        return dict(spec.component_bytes)
    own = DTYPE_BYTES[spec.dtype]
    return {name: size * per // own if name.startswith(QUANTIZED_PREFIXES) else size
            for name, size in spec.component_bytes.items()}
