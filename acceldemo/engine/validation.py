"""Every request checked in one place, early, into one typed `Request`; each refusal names the field, the value and
what is accepted. Also what a person is offered before asking: modes with why not, the proposed placement, TP sizes."""
from __future__ import annotations

import dataclasses
import math
import secrets
import unicodedata
from dataclasses import dataclass

from ..config import Settings
from ..errors import InvalidRequest, UnknownName, UnsupportedCombination
from ..hardware import Availability, Hardware, HardwareRegistry, all_modes, mode_note, offered_by
from ..models.caches import AUTO, NONE, STEP_CACHE_CHOICES
from ..models.catalog import QUALITIES, ModelSpec, cache_refusal, component_bytes_at, get_model
from ..models.loras import model_loras
from ..records import (
    CFG_RANKS,
    DeviceSet,
    GenerateParams,
    Mode,
    Placement,
    Quantization,
    Request,
    Shape,
    StepCache,
    world_size,
)
from .pictures import check_edit

MAX_PROMPT_CHARS = 2000
MAX_IMAGES = 4
MAX_GUIDANCE = 30.0
MAX_SEED = 2**63 - 1
MAX_LORA_SCALE = 2.0
# OpenAI's background values.
BACKGROUNDS = ("transparent", "opaque", "auto")
# What a request that names no mode gets.
DEFAULT_MODE = Mode.EAGER
# Room left for activations beside the weights when deciding what fits a device.
HEADROOM = 1.2
# Image tokens from which the proposal spreads one image's attention over devices (context parallel): 2048x2048 on
# the FLUX family. Below, devices serve more people as replicas than they save one person as a group.
CP_TOKENS = 16384


@dataclass(frozen=True)
class Option:
    """A choice shown to a person: usable or not, and why."""

    name: Mode
    ok: bool
    reason: str


@dataclass(frozen=True)
class PlacementProposal:
    """Where a model goes on a hardware: placement, tensor-parallel size, how many replicas the host holds, and why."""

    placement: Placement
    tp_size: int
    reason: str
    replicas: int = 1
    # Requests one call may draw together at the model's default shape (`batch_fit`).
    batch: int = 1
    cp_size: int = 1

    @property
    def world_size(self) -> int:
        return world_size(self.placement, self.tp_size, self.cp_size)


def mode_options(spec: ModelSpec, hardware: Hardware, placement: Placement | None) -> list[Option]:
    """Each mode for this model, hardware and placement, with why it is refused where it is."""
    options = []
    for mode in all_modes():
        if mode not in hardware.modes:
            reason = hardware.mode_refusal(mode) or \
                f"{hardware.name} does not offer it; only {', '.join(offered_by(mode))} does"
        elif mode is Mode.REGIONAL and not spec.repeated_blocks:
            reason = f"the {spec.title} transformer has no repeated blocks for compile_repeated_blocks"
        elif mode is Mode.COMPILED and placement is Placement.OFFLOAD:
            reason = "offload hooks cannot be traced: with offload only regional or eager"
        else:
            options.append(Option(mode, True, mode_note(mode)))
            continue
        options.append(Option(mode, False, reason))
    return options


def held_bytes(spec: ModelSpec, components: dict[str, int], placement: Placement, tp_size: int) -> float:
    """Weight bytes one device holds at once: all of them; with offload the largest component; with tensor
    parallelism its share of every sharded component and the whole of the others."""
    if placement is Placement.OFFLOAD:
        return max(components.values(), default=0)
    shardable = sum(size for name, size in components.items() if name in spec.tp_components)
    total = sum(components.values())
    return total if placement is not Placement.TP else shardable / max(tp_size, 1) + total - shardable


def batch_fit(spec: ModelSpec, memory_bytes: int, placement: Placement, tp_size: int, shape: Shape,
              quantization: Quantization = Quantization.NONE) -> int:
    """How many requests one call of this model may draw together at this shape: the model's own cap, within the
    memory a device has beside the weights it holds (all of them, its tensor-parallel share, or with offload the
    largest component; at their quantization), at the model's working memory per image and megapixel."""
    if not memory_bytes or not spec.activation_bytes:
        return spec.max_batch
    held = held_bytes(spec, component_bytes_at(spec, quantization), placement, tp_size)
    per_image = spec.activation_bytes * shape.width * shape.height / 1e6 / max(tp_size, 1)
    return max(1, min(spec.max_batch, int((memory_bytes - held) // per_image)))


def propose_placement(spec: ModelSpec, found: Availability, sizes: tuple[int, ...] | None = None,
                      max_batch: int | None = None, quantization: Quantization = Quantization.NONE,
                      shape: Shape | None = None) -> PlacementProposal:
    """Where the model should go on this hardware, from its weight sizes (at `quantization`), the device memory and
    count, and the image size (`shape`, the model's default by default); and how many requests one call may draw
    together there (`max_batch`: the operator's, which wins).

    sizes: the pool sizes the hardware's launcher accepts (`Hardware.tensor_parallel_sizes()`), None: any.
    """
    shape = shape or spec.default_shape
    proposal = _placement(spec, component_bytes_at(spec, quantization), found, sizes, shape)
    if quantization is not Quantization.NONE:
        proposal = dataclasses.replace(proposal, reason=f"{quantization} weights: {proposal.reason}")
    return dataclasses.replace(proposal, batch=max_batch or batch_fit(spec, found.memory_bytes, proposal.placement,
                                                                      proposal.tp_size, shape, quantization))


def _placement(spec: ModelSpec, components: dict[str, int], found: Availability,
               sizes: tuple[int, ...] | None, shape: Shape) -> PlacementProposal:
    memory = found.memory_bytes
    weight_bytes, largest = sum(components.values()), max(components.values(), default=0)
    gb = lambda n: f"{n / 1e9:.1f} GB"  # noqa: E731

    def copies(size: int) -> tuple[int, str]:
        count = max(found.device_count // size, 1)
        per = "one per device" if size == 1 else f"{size} devices each"
        return count, f": {count} replicas, {per}" if count > 1 else ""

    def launchable(size: int) -> bool:
        return size <= found.device_count and (sizes is None or size in sizes)

    if not memory or weight_bytes * HEADROOM <= memory:
        fits = f"{gb(weight_bytes)} of weights fit one device ({gb(memory)})"
        if spec.cfg_above is not None and spec.guidance > spec.cfg_above and launchable(CFG_RANKS):
            count, replicas = copies(CFG_RANKS)
            return PlacementProposal(Placement.CFG, 1, f"{fits}, and at guidance {spec.guidance:g} every step runs "
                                                       "two transformer branches: one per device halves the step (CFG "
                                                       f"parallel){replicas}", count)
        tokens = spec.image_tokens(shape)
        degrees = [n for n in (8, 4, 2)
                   if launchable(n) and spec.context_parallel and ulysses_splits(spec, tokens, n)]
        if tokens >= CP_TOKENS and degrees:
            count, replicas = copies(degrees[0])
            return PlacementProposal(Placement.CP, 1, f"{fits}, and {shape} is {tokens} image tokens: attention over "
                                                      f"them spread over {degrees[0]} devices (context parallel, "
                                                      f"Ulysses){replicas}", count, cp_size=degrees[0])
        count, replicas = copies(1)
        return PlacementProposal(Placement.DEVICE, 1, f"{gb(weight_bytes)} of weights fit one of "
                                                      f"{found.device_count} device(s) ({gb(memory)} each){replicas}",
                                 count)
    if largest * HEADROOM <= memory:
        count, replicas = copies(1)
        return PlacementProposal(Placement.OFFLOAD, 1, f"{gb(weight_bytes)} of weights exceed one device "
                                                       f"({gb(memory)}), but each component fits: offload moves one "
                                                       f"at a time{replicas}", count)
    per_device = lambda n: held_bytes(spec, components, Placement.TP, n)  # noqa: E731
    divisors = [count for _, count in spec.shard_divisors()]
    candidates = [n for n in (sizes or [2**k for k in range(1, 7)]) if n >= 2
                  and all(count % n == 0 for count in divisors)] or [2]
    size = next((n for n in candidates if per_device(n) * HEADROOM <= memory), candidates[-1])
    count, replicas = copies(size)
    beyond = f"; more than this host's {found.device_count} device(s): a pool across hosts" \
        if size > found.device_count else ""
    return PlacementProposal(Placement.TP, size, f"the largest component ({gb(largest)}) exceeds one device "
                                                 f"({gb(memory)}): tensor parallel over {size} holds "
                                                 f"{gb(per_device(size))} per device{beyond}{replicas}", count)


def _whole(field: str, value: object, low: int, high: int) -> int:
    accepted = f"a whole number from {low} to {high}"
    if isinstance(value, bool):
        raise InvalidRequest(field, value, accepted)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, str) and value.strip().lstrip("-").isdigit() and len(value.strip()) < 40:
        value = int(value.strip())
    if not isinstance(value, int) or not low <= value <= high:
        raise InvalidRequest(field, value, accepted)
    return value


def _number(field: str, value: object, low: float, high: float) -> float:
    accepted = f"a number from {low:g} to {high:g}"
    try:
        number = float(value) if not isinstance(value, bool) and len(str(value)) < 40 else math.nan
    except (TypeError, ValueError):
        raise InvalidRequest(field, value, accepted) from None
    if not math.isfinite(number) or not low <= number <= high:
        raise InvalidRequest(field, value, accepted)
    return number


def _named(field: str, value: object, kind: type, known) -> object:
    """`value` as a member of the enum `kind`, if it names one of `known`."""
    try:
        member = kind(value)
    except ValueError:
        member = None
    if member is None or member not in known:
        raise UnknownName(field, value, [str(k) for k in known])
    return member


def check_prompt(prompt: object) -> str:
    if not isinstance(prompt, str) or not prompt.strip():
        raise InvalidRequest("prompt", prompt, "a non-empty text")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise InvalidRequest("prompt", prompt, f"at most {MAX_PROMPT_CHARS} characters (got {len(prompt)})")
    if any(unicodedata.category(c) == "Cc" and c not in "\n\t" for c in prompt):
        raise InvalidRequest("prompt", prompt, "text without control characters")
    return prompt.strip()


def parse_resolution(text: object) -> Shape:
    """A typed resolution (WIDTHxHEIGHT) as a shape; the sizes themselves are checked per model later."""
    if isinstance(text, Shape):
        return text
    return _parsed("resolution", text, Shape.parse, 40, "WIDTHxHEIGHT, e.g. 1024x1024")


def _parsed(field: str, text: object, parse, longest: int, accepted: str):
    """`parse(text)` of a string shorter than `longest`, or InvalidRequest naming the field and what it accepts."""
    value = parse(text) if isinstance(text, str) and len(text) < longest else None
    if value is None:
        raise InvalidRequest(field, text, accepted)
    return value


def check_shape(spec: ModelSpec, width: object, height: object) -> Shape:
    """A size valid for the model: one of its presets where it draws correctly at those only, else within its range
    and a multiple of its granularity."""
    if spec.only_presets:
        presets = ", ".join(str(s) for s in spec.presets)
        shape = Shape(_whole("width", width, 1, 1 << 15), _whole("height", height, 1, 1 << 15))
        if shape not in spec.presets:
            raise InvalidRequest("resolution", str(shape), f"one of the sizes {spec.name} draws correctly: {presets}")
        return shape
    g, low, high = spec.granularity, spec.min_side, spec.max_side
    sides = {}
    for field, value in (("width", width), ("height", height)):
        side = _whole(field, value, low, high)
        if side % g:
            near = min(max(round(side / g) * g, low), high)
            raise InvalidRequest(field, side, f"{spec.name} needs a multiple of {g} "
                                              f"from {low} to {high} — try {near}")
        sides[field] = side
    return Shape(sides["width"], sides["height"])


def _absent(value: object) -> bool:
    """A raw value left out: None, or an empty text (a form's empty field)."""
    return value is None or value == ""


def check_request(params: GenerateParams, settings: Settings, hardware: HardwareRegistry) -> Request:
    """The request typed, with every default filled in; or the first thing wrong with it as a typed error."""
    spec = get_model(settings.default_model if _absent(params.model) else params.model)
    prompt = check_prompt(params.prompt)
    devices = check_devices(params.device)
    named = params.hardware if not _absent(params.hardware) else devices.hardware if devices else None
    adapter = hardware.require_available(named or hardware.best_available())
    mode = DEFAULT_MODE if _absent(params.mode) else _named("mode", params.mode, Mode, all_modes())
    chosen = None if _absent(params.placement) else _named("placement", params.placement, Placement, tuple(Placement))
    weights = Quantization.NONE if _absent(params.quantization) else \
        _named("quantization", params.quantization, Quantization, tuple(Quantization))
    proposed = propose_placement(spec, adapter.detect(), adapter.tensor_parallel_sizes(), quantization=weights)
    placement = chosen or proposed.placement
    for option in mode_options(spec, adapter, placement):
        if option.name is mode and not option.ok:
            raise UnsupportedCombination("mode", f"mode {str(mode)!r} is not possible here: {option.reason}")
    # Placement tp without a degree: the proposal's where it proposes tp, else the smallest (2), as cp does.
    tp_size = check_placement(spec, adapter, placement, params.tp_size or (
        proposed.tp_size if proposed.placement is Placement.TP else 2), settings.pool_nnodes)
    typed = None if _absent(params.resolution) else parse_resolution(params.resolution)
    shape = check_shape(spec, typed.width, typed.height) if typed else None
    num_images = 1 if _absent(params.num_images) else _whole("num_images", params.num_images, 1, MAX_IMAGES)
    # The last image's seed is seed + num_images - 1: every one of them must be a seed.
    top = MAX_SEED - num_images + 1
    seed = secrets.randbelow(top + 1) if _absent(params.seed) else _whole("seed", params.seed, 0, top)
    quality = None if _absent(params.quality) else _one_of("quality", params.quality, QUALITIES)
    check_background(spec, params.background)
    steps = (spec.steps_for(quality) if quality else spec.steps) if _absent(params.steps) else params.steps
    steps = _whole("steps", steps, 1, spec.max_steps)
    edit = None
    if not _absent(params.image) and params.image != []:
        edit, shape = check_edit(spec, params.image, params.mask, params.strength, shape)
    elif not _absent(params.mask) or not _absent(params.strength):
        field = "mask" if not _absent(params.mask) else "strength"
        raise InvalidRequest(field, "given without an image", "only with an image to edit")
    lora, lora_scale = check_lora(spec, settings, placement, params.lora, params.lora_scale)
    quantization = check_quantization(adapter, placement, weights)
    step_cache, why = check_step_cache(spec, mode, placement, steps, params.step_cache)
    request = Request(
        prompt=prompt, model=spec.name, graph=spec.graph_rule, hardware=adapter.name, mode=mode, placement=placement,
        tp_size=tp_size,
        shape=shape or spec.default_shape, steps=steps,
        guidance=_number("guidance", spec.guidance if _absent(params.guidance) else params.guidance,
                         0.0, MAX_GUIDANCE),
        seed=seed, num_images=num_images, devices=devices, quality=quality, previews=bool(params.previews),
        edit=edit, lora=lora, lora_scale=lora_scale, step_cache=step_cache,
        step_cache_asked=None if _absent(params.step_cache) else str(params.step_cache), step_cache_why=why,
        quantization=quantization)
    if placement is Placement.CP:
        request = dataclasses.replace(request, cp_size=check_context_parallel(
            spec, adapter, params.cp_size or (proposed.cp_size if proposed.placement is Placement.CP else 2),
            request.shape, request.references, settings.pool_nnodes, quantization))
    elif placement is Placement.CFG:
        check_cfg_parallel(spec, adapter, request.guidance, settings.pool_nnodes, quantization)
    if devices is not None:
        check_device_set(devices, adapter, local_devices(placement, request.world_size, settings.pool_nnodes))
    return request


def check_step_cache(spec: ModelSpec, mode: Mode, placement: Placement, steps: int,
                     asked: object) -> tuple[StepCache | None, str]:
    """The step cache a request runs with (None: none) and, for auto, why: the model's advice, in this mode."""
    if _absent(asked) or asked == NONE:
        return None, ""
    if asked not in STEP_CACHE_CHOICES:
        raise UnknownName("step_cache", asked, STEP_CACHE_CHOICES)
    if asked == AUTO:
        advice = spec.cache_advice
        cache = advice.resolve(steps)
        if cache is not None and step_cache_refusal(spec, cache, mode, placement) is not None:
            return None, f"{advice.why}; not in mode {mode}: {step_cache_refusal(spec, cache, mode, placement)}"
        return cache, advice.why
    cache = StepCache(asked)
    reason = step_cache_refusal(spec, cache, mode, placement)
    if reason:
        raise UnsupportedCombination("step_cache", f"step_cache {str(cache)!r} is not possible here: {reason}")
    return cache, ""


def step_cache_refusal(spec: ModelSpec, cache: StepCache, mode: Mode, placement: Placement) -> str | None:
    """Why this cache cannot run for this model in this mode and placement (None: it can)."""
    refusal = cache_refusal(spec, cache)
    if refusal:
        return refusal
    if cache.decides_per_call:
        return None
    if mode.compiles:
        return (f"in mode {mode} its hooks decide inside the transformer, in Python, which a fullgraph compile cannot "
                "trace: eager modes only (taylorseer decides before the transformer runs and works compiled)")
    if placement.pooled:
        return ("its hooks decide per rank inside the transformer, and a rank deciding otherwise would leave the "
                f"others waiting in a collective: with placement {placement} only taylorseer (decided from the step "
                "count, the same on every rank)")
    return None


def check_quantization(hardware: Hardware, placement: Placement, quantization: Quantization) -> Quantization:
    """The weights' quantization, where the hardware and placement can hold it."""
    if quantization is Quantization.NONE:
        return quantization
    if placement is Placement.TP:
        raise UnsupportedCombination("quantization", f"quantization {str(quantization)!r} is not possible with "
                                                     "tensor-parallel placement: diffusers' sharded loading refuses "
                                                     "quantized weights; run it on one device or with offload")
    refusal = hardware.quantization_refusal(quantization)
    if refusal:
        raise UnsupportedCombination("quantization", f"quantization {str(quantization)!r} is not possible on "
                                                     f"{hardware.name}: {refusal}")
    return quantization


def check_lora(spec: ModelSpec, settings: Settings, placement: Placement, name: object,
               scale: object) -> tuple[str | None, float]:
    """The LoRA style by name (one the model offers) and its strength; (None, 1.0) for none."""
    if _absent(name) or name == "none":
        if not _absent(scale) and name != "none":
            raise InvalidRequest("lora_scale", scale, "only with a LoRA style (lora)")
        return None, 1.0
    styles = model_loras(spec, settings)
    if name not in styles:
        if not styles:
            raise InvalidRequest("lora", name, f"none: {spec.name} offers no LoRA styles (ACCELDEMO_LORA_DIR/"
                                               f"{spec.name}/NAME.safetensors adds some)")
        raise UnknownName("lora", name, ["none", *styles])
    if placement is Placement.TP:
        raise UnsupportedCombination("lora", f"lora: styles are not offered with tensor-parallel placement yet "
                                             f"(sharded layers); run {spec.name} on one device or with offload")
    return str(name), 1.0 if _absent(scale) else _number("lora_scale", scale, 0.0, MAX_LORA_SCALE)


def _one_of(field: str, value: object, known: tuple[str, ...]) -> str:
    if value not in known:
        raise UnknownName(field, value, known)
    return value  # type: ignore[return-value]


def check_background(spec: ModelSpec, background: object) -> None:
    """OpenAI's background: opaque and auto always; transparent only where the model decodes an alpha channel."""
    if _absent(background):
        return
    _one_of("background", background, BACKGROUNDS)
    if background == "transparent" and not spec.alpha:
        raise InvalidRequest("background", background, f"opaque or auto: {spec.name} draws no alpha channel (its "
                                                       "VAE decodes RGB only)")


def check_placement(spec: ModelSpec, hardware: Hardware, placement: Placement, tp_size: object,
                    nodes: int = 1) -> int:
    """The tensor-parallel degree for this placement (1 unless tp), or why it cannot work."""
    refusal = hardware.placement_refusal(placement)
    if refusal:
        raise UnsupportedCombination("placement", f"placement {str(placement)!r} is not possible on "
                                                  f"{hardware.name}: {refusal}")
    if placement is not Placement.TP:
        return 1
    if not spec.tp_components:
        raise UnsupportedCombination("placement", f"{spec.title} has no tensor-parallel plan; use device or offload")
    size = _whole("tp_size", tp_size, 2, 64)
    undivided = [f"the {count} {what}" for what, count in spec.shard_divisors() if count % size]
    if undivided:
        raise InvalidRequest("tp_size", size, f"a divisor of {' and '.join(undivided)} (each rank holds a whole "
                                              "share of every sharded component's heads)")
    return check_pool_size("tp_size", size, hardware, nodes)


def check_pool_size(field: str, size: int, hardware: Hardware, nodes: int = 1) -> int:
    """A pool of `size` ranks this host (and the pool's other nodes) can launch."""
    if size % nodes:
        raise InvalidRequest(field, size, f"a multiple of the {nodes} nodes the worker pool spans "
                                          "(ACCELDEMO_POOL_NNODES)")
    refusal = hardware.tensor_parallel_refusal(size // nodes)
    if refusal:
        raise InvalidRequest(field, size, refusal)
    count = len(hardware.devices()) * nodes
    if not hardware.device_sets(size // nodes):  # CPU ranks share cores: every size has a group there
        where = "here" if nodes == 1 else f"on the pool's {nodes} nodes"
        raise InvalidRequest(field, size, f"at most the {count} {hardware.name} devices {where}")
    return size


def whole_weights_refusal(spec: ModelSpec, hardware: Hardware, placement: Placement,
                          quantization: Quantization = Quantization.NONE) -> str | None:
    """Why every rank cannot hold the whole pipeline (cfg and cp shard no weights); None when one device can."""
    memory = hardware.detect().memory_bytes
    weights = sum(component_bytes_at(spec, quantization).values())
    if not memory or weights * HEADROOM <= memory:
        return None
    return (f"placement {str(placement)!r} holds the whole pipeline on every rank, and its {weights / 1e9:.1f} GB of "
            f"weights exceed one {hardware.name} device ({memory / 1e9:.1f} GB): tp shards them")


def check_cfg_parallel(spec: ModelSpec, hardware: Hardware, guidance: float, nodes: int = 1,
                       quantization: Quantization = Quantization.NONE) -> None:
    """CFG parallel splits the two guidance branches of each step over two ranks: the model must run both, and each
    rank holds it whole."""
    if spec.cfg_above is None:
        raise UnsupportedCombination("placement", f"placement 'cfg' is not possible here: {spec.title} runs one "
                                                  "transformer branch per step (it is guidance-distilled: no "
                                                  "unconditional branch to split off); use device, or tp or cp")
    if guidance <= spec.cfg_above:
        raise InvalidRequest("guidance", guidance, f"above {spec.cfg_above:g} with placement 'cfg': at "
                                                   f"{guidance:g} {spec.name} runs one branch, nothing to split")
    refusal = whole_weights_refusal(spec, hardware, Placement.CFG, quantization)
    if refusal:
        raise UnsupportedCombination("placement", refusal)
    check_pool_size("placement", CFG_RANKS, hardware, nodes)


def text_tokens(spec: ModelSpec) -> int:
    """The text tokens a prompt takes in the transformer (the pipelines' default 512 where the model sets none)."""
    return spec.max_sequence_length or 512


def ulysses_splits(spec: ModelSpec, image_tokens: int, degree: int) -> bool:
    """Whether Ulysses attention can spread this model over `degree` ranks: each rank takes a whole share of the
    attention heads, of the image tokens and of the text tokens."""
    return not (spec.attention_heads % degree or image_tokens % degree or text_tokens(spec) % degree)


def check_context_parallel(spec: ModelSpec, hardware: Hardware, size: object, shape: Shape, references: int = 0,
                           nodes: int = 1, quantization: Quantization = Quantization.NONE) -> int:
    """The context-parallel degree: Ulysses attention splits the image and text tokens over the ranks and all-to-alls
    the heads, so the degree must divide the heads and both token counts, and the host must have the devices; each
    rank holds the whole pipeline."""
    if not spec.context_parallel:
        raise UnsupportedCombination("placement", f"placement 'cp' is not possible here: {spec.title}'s transformer "
                                                  "has no context-parallel plan in diffusers 0.42.1 (no _cp_plan)")
    refusal = whole_weights_refusal(spec, hardware, Placement.CP, quantization)
    if refusal:
        raise UnsupportedCombination("placement", refusal)
    degree = _whole("cp_size", size, 2, 64)
    working = context_parallel_degrees(spec, hardware, shape, references, nodes)
    if degree not in working:
        tokens = spec.image_tokens(shape, references)
        raise InvalidRequest("cp_size", degree, f"a degree that divides the {spec.attention_heads} attention heads, "
                                                f"the {tokens} image tokens at {shape} and the {text_tokens(spec)} "
                                                f"text tokens, with that many {hardware.name} devices here: "
                                                + (", ".join(map(str, working)) or "none at this shape")
                                                + " (Ulysses attention; ring attention, which would take any degree, "
                                                  "needs an attention backend that returns the log-sum-exp, which "
                                                  "diffusers' native one does not: not wired here)")
    return degree


def context_parallel_degrees(spec: ModelSpec, hardware: Hardware, shape: Shape, references: int = 0,
                             nodes: int = 1) -> list[int]:
    """Every context-parallel degree that works for this model, shape and host."""
    tokens = spec.image_tokens(shape, references)
    working = []
    for degree in range(2, 65):
        if not ulysses_splits(spec, tokens, degree):
            continue
        try:
            working.append(check_pool_size("cp_size", degree, hardware, nodes))
        except InvalidRequest:
            continue
    return working


def tensor_parallel_options(spec: ModelSpec, hardware: Hardware, nodes: int = 1) -> list[int]:
    """Every tensor-parallel size a request for this model on this hardware would be accepted with."""
    accepted = []
    for size in range(2, 65):
        try:
            accepted.append(check_placement(spec, hardware, Placement.TP, size, nodes))
        except (InvalidRequest, UnsupportedCombination):
            continue
    return accepted


def local_devices(placement: Placement, world: int, nodes: int) -> int:
    """How many devices of this host one pipeline occupies: its share of a pool's ranks, else one."""
    return world // nodes if placement.pooled else 1


def check_devices(text: object) -> DeviceSet | None:
    """A device set a request names (`cuda:1`, `neuron:0-1`), or None when it names none."""
    if text is None or text == "":
        return None
    return _parsed("device", text, DeviceSet.parse, 80,
                   "a device as hardware:index (cpu:0, cuda:1) or a group (neuron:0-1)")


def check_device_set(devices: DeviceSet, hardware: Hardware, size: int) -> None:
    """The named devices must be one of the groups this hardware offers a pipeline of that size."""
    if devices.hardware != hardware.name:
        raise UnsupportedCombination("device", f"device {devices} is not a {hardware.name} device")
    offered = hardware.device_sets(size)
    if devices not in offered:
        raise InvalidRequest("device", str(devices), f"one of {', '.join(map(str, offered))} here"
                             if offered else f"none: {hardware.name} has no group of {size} device(s) here")
