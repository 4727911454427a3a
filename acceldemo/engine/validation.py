"""Every request checked in one place, early; each refusal names the field, the value and what is accepted."""
from __future__ import annotations

import math
import unicodedata
from dataclasses import dataclass, replace

from ..errors import InvalidRequest, UnknownName, UnsupportedCombination
from ..executors.pool import pool_nodes
from ..hardware import ALL_MODES, Availability, Hardware, best_available, get_hardware, require_available
from ..models.catalog import ModelSpec, get_model
from ..records import GenerateRequest, Shape

PLACEMENTS = ("device", "offload", "tp")
MAX_PROMPT_CHARS = 2000
MAX_IMAGES = 4
MAX_GUIDANCE = 30.0
MAX_SEED = 2**63 - 1
# Room left for activations beside the weights when deciding what fits a device.
HEADROOM = 1.2

MODE_NOTES = {
    "eager": "each op runs as it is issued",
    "eager-fused": "TorchTPU defers ops and fuses them into larger graphs (EagerMode.DEFER_AND_FUSE)",
    "compiled": "whole transformer compiled per static shape (fullgraph, dynamic=False)",
    "regional": "the repeated transformer block compiled once and reused (compile_repeated_blocks)",
}


@dataclass(frozen=True)
class Option:
    """A choice shown to a person: usable or not, and why."""

    name: str
    ok: bool
    reason: str


@dataclass(frozen=True)
class Placement:
    name: str
    tp_size: int
    reason: str


def mode_options(spec: ModelSpec, hardware: Hardware, placement: str | None) -> list[Option]:
    """Each mode for this model, hardware and placement, with why it is refused where it is."""
    options = []
    for mode in ALL_MODES:
        if mode not in hardware.modes:
            offered = [h for h in _hardware_names() if mode in get_hardware(h).modes]
            reason = f"{hardware.name} does not offer it; only {', '.join(offered)} does"
        elif mode == "regional" and not spec.repeated_blocks:
            reason = f"the {spec.title} transformer has no repeated blocks for compile_repeated_blocks"
        elif mode == "compiled" and placement == "offload":
            reason = "offload hooks cannot be traced: with offload only regional or eager"
        else:
            options.append(Option(mode, True, MODE_NOTES[mode]))
            continue
        options.append(Option(mode, False, reason))
    return options


def _hardware_names() -> list[str]:
    from ..hardware import HARDWARE

    return list(HARDWARE)


def propose_placement(spec: ModelSpec, found: Availability, sizes: tuple[int, ...] | None = None) -> Placement:
    """Where the model should go on this hardware, from its weight sizes and the device memory.

    sizes: the tensor-parallel sizes the hardware's launcher accepts (`Hardware.tensor_parallel_sizes()`), None: any.
    """
    memory = found.memory_bytes
    weights = spec.weight_bytes * HEADROOM
    gb = lambda n: f"{n / 1e9:.1f} GB"  # noqa: E731
    if not memory or weights <= memory:
        return Placement("device", 1, f"{gb(spec.weight_bytes)} of weights fit one device ({gb(memory)})")
    if spec.largest_component_bytes * HEADROOM <= memory:
        return Placement("offload", 1, f"{gb(spec.weight_bytes)} of weights exceed one device ({gb(memory)}), "
                                       f"but each component fits: offload moves one at a time")
    candidates = [n for n in sizes if n >= 2] if sizes else [2**k for k in range(1, 7)]
    size = next((n for n in candidates if n > max(found.device_count, 2)
                 or spec.largest_component_bytes * HEADROOM / n <= memory), candidates[-1])
    return Placement("tp", size, f"the largest component ({gb(spec.largest_component_bytes)}) exceeds one device "
                                 f"({gb(memory)}): tensor parallel over {size}")


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
    shape = Shape.parse(text) if isinstance(text, str) and len(text) < 40 else None
    if shape is None:
        raise InvalidRequest("resolution", text, "WIDTHxHEIGHT, e.g. 1024x1024")
    return shape


def check_shape(spec: ModelSpec, width: object, height: object) -> Shape:
    """A size valid for the model: within its range and a multiple of its granularity."""
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


def check_request(request: GenerateRequest) -> GenerateRequest:
    """The request with every default filled in, or the first thing wrong with it as a typed error."""
    spec = get_model(request.model)
    prompt = check_prompt(request.prompt)
    hardware = require_available(request.hardware or best_available())
    if request.mode not in ALL_MODES:
        raise UnknownName("mode", request.mode, ALL_MODES)
    if request.placement is not None and request.placement not in PLACEMENTS:
        raise UnknownName("placement", request.placement, PLACEMENTS)
    proposed = propose_placement(spec, hardware.detect(), hardware.tensor_parallel_sizes())
    placement = request.placement or proposed.name
    for option in mode_options(spec, hardware, placement):
        if option.name == request.mode and not option.ok:
            raise UnsupportedCombination("mode", f"mode {request.mode!r} is not possible here: {option.reason}")
    tp_size = check_placement(spec, hardware, placement, request.tp_size or proposed.tp_size)
    shape = check_shape(spec, spec.default_shape.width if request.width is None else request.width,
                        spec.default_shape.height if request.height is None else request.height)
    return replace(
        request, model=spec.name, prompt=prompt, hardware=hardware.name, placement=placement, tp_size=tp_size,
        width=shape.width, height=shape.height,
        steps=_whole("steps", spec.steps if request.steps is None else request.steps, 1, spec.max_steps),
        guidance=_number("guidance", spec.guidance if request.guidance is None else request.guidance,
                         0.0, MAX_GUIDANCE),
        seed=_whole("seed", request.seed, 0, MAX_SEED),
        num_images=_whole("num_images", request.num_images, 1, MAX_IMAGES))


def check_placement(spec: ModelSpec, hardware: Hardware, placement: str, tp_size: int) -> int:
    """The tensor-parallel degree for this placement (1 unless tp), or why it cannot work."""
    if placement != "tp":
        return 1
    if not spec.tp_components:
        raise UnsupportedCombination("placement", f"{spec.title} has no tensor-parallel plan; use device or offload")
    size = _whole("tp_size", tp_size, 2, 64)
    if spec.attention_heads % size:
        raise InvalidRequest("tp_size", size, f"a divisor of the {spec.attention_heads} attention heads")
    nodes = pool_nodes()
    if size % nodes:
        raise InvalidRequest("tp_size", size, f"a multiple of the {nodes} nodes the worker pool spans "
                                              "(ACCELDEMO_POOL_NNODES)")
    refusal = hardware.tensor_parallel_refusal(size // nodes)
    if refusal:
        raise InvalidRequest("tp_size", size, refusal)
    count = hardware.detect().device_count * nodes
    if hardware.name != "cpu" and size > count:
        where = "here" if nodes == 1 else f"on the pool's {nodes} nodes"
        raise InvalidRequest("tp_size", size, f"at most the {count} {hardware.name} devices {where}")
    return size
