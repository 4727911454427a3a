"""Records that cross layers: the names a person picks (modes, placements), states and phases, requests as front
ends give them and as the engine checked them, progress events and results."""
from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

_SIZE = re.compile(r"^\s*(\d+)\s*[xX×]\s*(\d+)\s*$")
_DEVICES = re.compile(r"^\s*([a-z][a-z0-9_]*):(\d{1,4}(?:-\d{1,4})?(?:,\d{1,4}(?:-\d{1,4})?)*)\s*$")


class Mode(StrEnum):
    """How the transformer runs: op by op (the eager flavours a hardware offers), or compiled per static shape."""

    EAGER = "eager"
    EAGER_FUSED = "eager-fused"  # TorchTPU's DEFER_AND_FUSE
    COMPILED = "compiled"  # the whole transformer, fullgraph, dynamic=False
    REGIONAL = "regional"  # compile_repeated_blocks

    @property
    def compiles(self) -> bool:
        return self in COMPILED_MODES


# Every hardware offers both; the eager modes are each adapter's own.
COMPILED_MODES = (Mode.COMPILED, Mode.REGIONAL)


class Placement(StrEnum):
    """Where a pipeline goes: whole on one device, model CPU offload, or split over a torchrun worker pool — its
    weights sharded (tensor parallel), its two guidance branches one per rank (CFG parallel), or its image tokens
    spread over the ranks (context parallel, Ulysses attention)."""

    DEVICE = "device"
    OFFLOAD = "offload"
    TP = "tp"
    CFG = "cfg"
    CP = "cp"

    @property
    def pooled(self) -> bool:
        """Whether it runs on a worker pool of several ranks."""
        return self in POOL_PLACEMENTS


POOL_PLACEMENTS = (Placement.TP, Placement.CFG, Placement.CP)
# Ranks of a CFG-parallel pool: one per guidance branch (conditional, unconditional).
CFG_RANKS = 2


def world_size(placement: Placement, tp_size: int, cp_size: int) -> int:
    """Ranks one pipeline of this placement spans (1 off a pool)."""
    return {Placement.TP: tp_size, Placement.CFG: CFG_RANKS, Placement.CP: cp_size}.get(placement, 1)


def placement_label(placement: Placement, tp_size: int, cp_size: int) -> str:
    """The placement as a person reads it: device, offload, tp2, cfg2, cp4."""
    return f"{placement}{world_size(placement, tp_size, cp_size)}" if placement.pooled else str(placement)


class StepCache(StrEnum):
    """The step caches diffusers 0.42.1 ships (`transformer.enable_cache(config)`), by the name a person picks; what
    each is and which models offer it: `models.caches`."""

    TAYLORSEER = "taylorseer"
    FIRST_BLOCK = "first-block"
    MAG = "mag"
    PAB = "pab"
    FASTER = "faster"
    SEA = "sea"

    @property
    def decides_per_call(self) -> bool:
        """Whether it decides before the transformer runs, from the step count alone (TaylorSeer, at the call seam),
        rather than in hooks inside the transformer, which a fullgraph compile cannot trace."""
        return self is StepCache.TAYLORSEER


class Quantization(StrEnum):
    """Weights stored in fewer bits (torchao, through diffusers' PipelineQuantizationConfig)."""

    NONE = "none"
    INT8 = "int8"  # int8 weight-only: int8 weights dequantized into the matmul; runs on CPU too
    FP8 = "fp8"  # float8 (e4m3) weight-only, where the hardware has fp8 matmuls

    @property
    def bytes_per_weight(self) -> int | None:
        """Bytes of one quantized weight (None: the model's own dtype)."""
        return None if self is Quantization.NONE else 1


class Phase(StrEnum):
    """What a request is doing, as its progress events say."""

    QUEUE = "queue"  # waiting in line for a device (or just given one)
    LOAD = "load"
    COMPILE = "compile"
    DENOISE = "denoise"
    DECODE = "decode"


class ShapeState(StrEnum):
    """One static shape of one pipeline."""

    COLD = "cold"
    COMPILING = "compiling"
    READY = "ready"
    FAILED = "failed"


class ReplicaState(StrEnum):
    """One replica (a device set holding pipelines)."""

    IDLE = "idle"
    LOADING = "loading"
    COMPILING = "compiling"
    BUSY = "busy"
    RESTARTING = "restarting"
    DOWN = "down"


@dataclass(frozen=True, order=True)
class Shape:
    """An image size as a person writes it: WIDTHxHEIGHT."""

    width: int
    height: int

    def __str__(self) -> str:
        return f"{self.width}x{self.height}"

    @staticmethod
    def parse(text: str) -> Shape | None:
        """The shape written as WxH, or None when the text is not of that form."""
        match = _SIZE.match(str(text))
        return Shape(int(match[1]), int(match[2])) if match else None


@dataclass(frozen=True, order=True)
class DeviceSet:
    """Devices of one hardware that one pipeline occupies, as a person writes them: `cpu:0`, `cuda:3`,
    `neuron:0-1` (a group of NeuronCores for tensor parallelism), `cuda:0,2`."""

    hardware: str
    indices: tuple[int, ...]

    def __str__(self) -> str:
        first, last = self.indices[0], self.indices[-1]
        if len(self.indices) > 1 and self.indices == tuple(range(first, last + 1)):
            return f"{self.hardware}:{first}-{last}"
        return f"{self.hardware}:{','.join(map(str, self.indices))}"

    def __len__(self) -> int:
        return len(self.indices)

    def overlaps(self, other: DeviceSet) -> bool:
        return self.hardware == other.hardware and bool(set(self.indices) & set(other.indices))

    @staticmethod
    def parse(text: str) -> DeviceSet | None:
        """`hw:i`, `hw:i-j` or `hw:i,j,...` as a device set; None when the text is not of that form."""
        match = _DEVICES.match(str(text))
        if not match:
            return None
        indices: list[int] = []
        for part in match[2].split(","):
            low, _, high = part.partition("-")
            indices.extend(range(int(low), int(high or low) + 1))
        if not indices or len(set(indices)) != len(indices):
            return None
        return DeviceSet(match[1], tuple(sorted(indices)))


@dataclass(frozen=True)
class GenerateParams:
    """A text-to-image request as a front end received it: raw values (text from a form, numbers from JSON), not
    yet checked. None is the default: the model's (size, steps, guidance), the host's (model, hardware, placement,
    devices), the engine's (mode eager, one image, a random seed). `Engine.check` turns it into a `Request`."""

    prompt: object
    model: object = None
    hardware: object = None
    mode: object = None
    placement: object = None
    tp_size: object = None
    # Context-parallel degree (ranks the image tokens are spread over) with placement cp.
    cp_size: object = None
    # WIDTHxHEIGHT as typed, or a Shape.
    resolution: object = None
    steps: object = None
    guidance: object = None
    seed: object = None
    # Images of one call, with the seeds seed, seed+1, ...: image i is the image seed+i gives alone.
    num_images: object = None
    # A device set to run on (`cuda:1`, `neuron:0-1`); None lets the engine pick a free one.
    device: object = None
    # OpenAI's quality names (low, medium, high, auto; DALL-E 3's standard, hd): the model's steps preset for it,
    # when no steps are given.
    quality: object = None
    # OpenAI's background (transparent, opaque, auto): transparent only where the model draws an alpha channel.
    background: object = None
    # True: the progress events carry previews of the image as it forms (see `Preview`).
    previews: object = None
    # An edit: the picture(s) to start from (encoded bytes as uploaded, a PIL image, or a list of them), the region
    # that may change (OpenAI's mask: a PNG, transparent where the picture changes) and how much it changes (0, 1].
    image: object = None
    mask: object = None
    strength: object = None
    # A LoRA style by name (one the model offers; None or "none": no style) and its strength.
    lora: object = None
    lora_scale: object = None
    # A step cache by name (`models.caches.STEP_CACHE_CHOICES`: none, auto — the model's advice —, or a cache the
    # model offers for the request's mode) and the weights' quantization (none, int8, fp8).
    step_cache: object = None
    quantization: object = None


class EditMethod(StrEnum):
    """How a picture is edited: noised to the strength's sigma and the rest denoised (image-to-image); given to the
    transformer as reference images it attends to (FLUX.2); or, as image-to-image, only inside a mask (inpainting)."""

    STRENGTH = "strength"
    REFERENCE = "reference"
    INPAINT = "inpaint"


# The ways of editing that denoise from the picture noised to a strength's sigma (image-to-image, inpainting).
STRENGTH_METHODS = (EditMethod.STRENGTH, EditMethod.INPAINT)


@dataclass(frozen=True)
class EditInput:
    """The picture(s) a request changes, checked: each at the request's size as PNG bytes, the region that may change
    (a PNG mask at that size, white where it changes; None: all of it), the strength, how the model edits
    ("strength": noise the picture to the strength's sigma and denoise the rest; "reference": reference images the
    transformer attends to; "inpaint": as "strength", only inside the mask) and what was uploaded (for the facts)."""

    images: tuple[bytes, ...]
    method: EditMethod
    strength: float
    mask: bytes | None = None
    source: str = ""

    def pictures(self) -> list:
        from io import BytesIO

        from PIL import Image

        return [Image.open(BytesIO(data)).convert("RGB") for data in self.images]

    def mask_picture(self):
        from io import BytesIO

        from PIL import Image

        return Image.open(BytesIO(self.mask)).convert("L") if self.mask else None

    def denoise_steps(self, steps: int) -> int:
        """The steps a strength edit denoises of `steps` (diffusers' image-to-image rule); all of them otherwise."""
        if self.method not in STRENGTH_METHODS:
            return steps
        return steps - int(max(steps - min(steps * self.strength, steps), 0))

    def facts(self) -> dict:
        return {"method": str(self.method), "strength": self.strength if self.method in STRENGTH_METHODS else None,
                "images": len(self.images), "mask": self.mask is not None, "source": self.source}


@dataclass(frozen=True)
class GraphRule:
    """What of a model decides when torch.compile builds a new graph (the catalog's `ModelSpec.graph_rule`): a
    request carries it beside its model's name, so that it stays small, hashable and cheap to send to pool ranks and
    fleet replicas."""

    granularity: int
    packed_latents: bool
    cfg_above: float | None
    max_sequence_length: int | None
    # FLUX.2's way of editing: the pictures are references the transformer attends to (an inpainting too).
    reference_edits: bool = False

    def image_tokens(self, shape: Shape, references: int = 0) -> int:
        """The transformer's image tokens at this size (reference pictures, each at the image's size, add as many
        again): one per granularity-square of pixels (the VAE's downsampling times the 2x2 packing or patches)."""
        return (shape.width // self.granularity) * (shape.height // self.granularity) * (1 + references)

    def key(self, shape: Shape, num_images: int, guidance: float, references: int = 0) -> tuple:
        """What really makes torch.compile build a new graph for this model: the image token count (packed
        latents; reference pictures, each at the image's size, add as many again) or the latent size, the
        transformer batch (classifier-free guidance doubles it) and the text length; the prompt, seed, steps,
        guidance value, LoRA style and its strength do not."""
        batch = num_images * (2 if self.cfg_above is not None and guidance > self.cfg_above else 1)
        size = (self.image_tokens(shape, references),) if self.packed_latents else (shape.width, shape.height)
        return (*size, batch, self.max_sequence_length)


@dataclass(frozen=True)
class Request:
    """A checked request: every value typed, every default resolved. Only the engine makes one
    (`Engine.check`); executors, the worker pool and the bench accept nothing else. It names its model (the catalog
    key): whoever needs the model's spec looks it up."""

    prompt: str
    model: str
    hardware: str
    mode: Mode
    placement: Placement
    tp_size: int
    shape: Shape
    steps: int
    guidance: float
    seed: int
    # When the model's compiled graphs are reused (see `graph_key`).
    graph: GraphRule
    num_images: int = 1
    # The device set the person named; None: any replica of the hardware.
    devices: DeviceSet | None = None
    # The quality preset asked for (None: none); it chose the steps unless steps were given too.
    quality: str | None = None
    # Whether the progress events carry previews of the image as it forms.
    previews: bool = False
    # The picture(s) it edits (None: text to image).
    edit: EditInput | None = None
    # The LoRA style it is drawn with (None: none) and that style's strength.
    lora: str | None = None
    lora_scale: float = 1.0
    # The step cache it runs with (None: none), what was asked for (None: nothing, "auto", or the cache's name) and,
    # for auto, why it came to that.
    step_cache: StepCache | None = None
    step_cache_asked: str | None = None
    step_cache_why: str = ""
    # The weights' quantization (a pipeline of its own, like a mode).
    quantization: Quantization = Quantization.NONE
    # The context-parallel degree (placement cp; 1 otherwise).
    cp_size: int = 1

    @property
    def world_size(self) -> int:
        return world_size(self.placement, self.tp_size, self.cp_size)

    @property
    def width(self) -> int:
        return self.shape.width

    @property
    def height(self) -> int:
        return self.shape.height

    @property
    def seeds(self) -> tuple[int, ...]:
        return tuple(range(self.seed, self.seed + self.num_images))

    @property
    def graph_key(self) -> tuple:
        """What makes torch.compile build a new graph for this request (the model says: see `ModelSpec.graph_key`)."""
        return self.graph.key(self.shape, self.num_images, self.guidance, self.references)

    @property
    def references(self) -> int:
        """Reference pictures the transformer attends to (each adds its tokens to the static shape): an edit's with
        reference pictures, and the picture a FLUX.2 klein inpainting repaints (diffusers' pipeline conditions on it
        as on a reference)."""
        if self.edit is None:
            return 0
        if self.edit.method == EditMethod.REFERENCE:
            return len(self.edit.images)
        return 1 if self.edit.method == EditMethod.INPAINT and self.graph.reference_edits else 0

    @property
    def denoise_steps(self) -> int:
        """The steps the call denoises: all of them, or a strength edit's share."""
        return self.edit.denoise_steps(self.steps) if self.edit else self.steps

    @property
    def batch_key(self) -> tuple:
        """What requests drawn in one pipeline call have in common: the pipeline and every call setting but the
        prompt and the seed (a call has one LoRA style at one strength, one step cache)."""
        return (self.model, self.hardware, self.mode, self.placement, self.tp_size, self.cp_size, self.quantization,
                self.shape, self.steps, self.guidance, self.lora, self.lora_scale, self.step_cache)

    @property
    def image_key(self) -> tuple:
        """Every value that shapes the image (the result cache's key): not where it runs, nor whether it previews."""
        edit = None
        if self.edit is not None:
            import hashlib

            digest = hashlib.sha256(b"".join(self.edit.images) + (self.edit.mask or b"")).hexdigest()
            edit = (self.edit.method, self.edit.strength, len(self.edit.images), digest)
        return (*self.batch_key, self.prompt, self.seed, self.num_images, edit)

    def key(self, devices: DeviceSet) -> PipelineKey:
        """The pipeline that runs this request on `devices`."""
        return PipelineKey(self.model, self.hardware, self.mode, self.placement, self.tp_size, devices,
                           self.quantization, self.cp_size)

    def members(self) -> list[Request]:
        """One request per image, each with its own seed: how the engine runs the images of a request (each is the
        image its seed gives alone)."""
        if self.num_images == 1:
            return [self]
        return [replace(self, seed=seed, num_images=1) for seed in self.seeds]

    def at(self, shape: Shape, steps: int | None = None) -> Request:
        """The same request at another of the model's shapes (a warm-up's), already checked against the model."""
        return replace(self, shape=shape, steps=self.steps if steps is None else steps)


@dataclass(frozen=True)
class Batch:
    """Requests drawn in one pipeline call: one pipeline, shape, steps and guidance (one `batch_key`), each request
    with its own prompt and its own generator per image, so each image is the one its seed gives alone.

    `size`: the images the call draws — in a compiled mode a bucket the graphs were built for. Images past the
    requests' own are padding (the first request again), drawn and dropped.
    """

    requests: tuple[Request, ...]
    size: int = 0

    def __post_init__(self) -> None:
        if not self.requests or len({r.batch_key for r in self.requests}) != 1:
            raise ValueError("a batch is one or more requests with one batch_key")
        if not self.size:
            object.__setattr__(self, "size", self.images)
        if self.size < self.images:
            raise ValueError(f"a batch of {self.images} images cannot be drawn at size {self.size}")

    @staticmethod
    def of(request: Request | Batch) -> Batch:
        return request if isinstance(request, Batch) else Batch((request,))

    @property
    def first(self) -> Request:
        return self.requests[0]

    @property
    def images(self) -> int:
        """The requests' own images (padding not counted)."""
        return sum(r.num_images for r in self.requests)

    @property
    def prompts(self) -> list[str]:
        """One prompt per image of the call, padding included."""
        own = [r.prompt for r in self.requests for _ in range(r.num_images)]
        return own + [self.first.prompt] * (self.size - len(own))

    @property
    def seeds(self) -> list[int]:
        """One seed per image of the call, padding included."""
        own = [seed for r in self.requests for seed in r.seeds]
        return own + [self.first.seed] * (self.size - len(own))

    @property
    def graph_key(self) -> tuple:
        """What makes torch.compile build a new graph: the call's batch size is part of its static shape."""
        return self.first.graph.key(self.first.shape, self.size, self.first.guidance, self.first.references)

    @property
    def label(self) -> str:
        """The shape, and the batch size when it is more than one image: `64x64`, `64x64 ×4`."""
        return str(self.first.shape) if self.size == 1 else f"{self.first.shape} ×{self.size}"

    def split(self, images: list) -> list[list]:
        """The call's images handed back to each request, in order (the padding's dropped)."""
        parts, at = [], 0
        for request in self.requests:
            parts.append(images[at:at + request.num_images])
            at += request.num_images
        return parts


@dataclass(frozen=True)
class PipelineKey:
    """What keeps one pipeline resident: a model on a device set in a mode and placement."""

    model: str
    hardware: str
    mode: Mode
    placement: Placement
    tp_size: int = 1
    devices: DeviceSet | None = None
    quantization: Quantization = Quantization.NONE
    cp_size: int = 1

    @property
    def world_size(self) -> int:
        return world_size(self.placement, self.tp_size, self.cp_size)

    def __str__(self) -> str:
        where = placement_label(self.placement, self.tp_size, self.cp_size)
        weights = "" if self.quantization is Quantization.NONE else f" · {self.quantization}"
        return f"{self.model} · {self.devices or self.hardware} · {self.mode} · {where}{weights}"


@dataclass(frozen=True)
class Preview:
    """The image so far, decoded cheaply from the latents after a denoise step: RGB pixels (a uint8 array of
    height × width × 3, at the latents' resolution) and the image size it stands for."""

    pixels: Any
    shape: Shape
    step: int
    total: int

    def image(self):
        """The preview as a PIL image at the image's size (smoothly scaled up from the latents' resolution)."""
        from PIL import Image

        picture = Image.fromarray(self.pixels, "RGB")
        if picture.size == (self.shape.width, self.shape.height):
            return picture
        return picture.resize((self.shape.width, self.shape.height), Image.Resampling.BILINEAR)


@dataclass(frozen=True)
class Progress:
    """One progress event of one request."""

    phase: Phase
    message: str
    step: int | None = None
    total: int | None = None
    elapsed: float = 0.0
    # A denoise step's picture of the image so far (requests asking for previews).
    preview: Preview | None = None
    # Which image of a request of several (its seed is seed + image).
    image: int = 0
    # A compile whose kind was compiled on this host before: the seconds it is expected to take (the bar advances
    # by elapsed ÷ expected); None while nothing is known.
    expected: float | None = None

    @property
    def fraction(self) -> float | None:
        """How far along this phase is, when that is known: steps done, or a compile's elapsed ÷ expected."""
        if self.step and self.total:
            return self.step / self.total
        if self.expected:
            return min(self.elapsed / self.expected, 0.99)
        return None


ProgressCallback = Callable[[Progress], None]


def no_progress(_: Progress) -> None:
    """A progress callback that drops every event."""


@dataclass(frozen=True)
class CacheUse:
    """What a step cache did in one pipeline call: the transformer calls, and those it answered (in full for
    TaylorSeer; for diffusers' block caches, calls whose last block's attention it did not compute). `name` None:
    no cache ran (every call computed)."""

    name: str | None
    calls: int
    skipped: int

    def facts(self) -> dict:
        return {"ran": self.name or "none", "calls": self.calls, "skipped": self.skipped}


# The platform's token for the visitor a pipeline call draws for (a ZeroGPU Space's X-IP-Token header), set by the
# engine around the call: the executor that asks the platform for a GPU passes it on, so the visitor's own quota is
# charged. None: no visitor token (a client of the API, a warm-up).
VISITOR_TOKEN: ContextVar[str | None] = ContextVar("acceldemo_visitor_token", default=None)


@dataclass(frozen=True)
class GpuLease:
    """A GPU a platform lent one pipeline call (ZeroGPU): the slice, the seconds asked for, the seconds from asking to
    the result, the seconds of those the pipeline call itself took (the rest is the lending: scheduling, a fork, the
    move to the GPU, the pipe), and the process it ran in."""

    size: str
    asked_seconds: int
    used_seconds: float
    call_seconds: float
    pid: int

    def facts(self) -> dict[str, Any]:
        return {"size": self.size, "asked_seconds": self.asked_seconds, "used_seconds": round(self.used_seconds, 4),
                "lending_seconds": round(self.used_seconds - self.call_seconds, 4)}


@dataclass(frozen=True)
class RunOutput:
    """What an executor returns for one pipeline call, before the engine adds its bookkeeping."""

    images: list
    seconds: float
    new_graphs: int
    compile_seconds: float
    compile_cache_hits: int = 0
    step_seconds: list[float] = field(default_factory=list)
    # Seconds the call spent making previews (0 without them).
    preview_seconds: float = 0.0
    # Precompiled packages this call built, loaded or rejected as unusable, fetched from or published to the shared
    # store (its process's store counts them); and, when it used the shared store, the store's outage (None: it
    # answered), so the engine's views show what a worker process ran into.
    package_events: dict[str, int] = field(default_factory=dict)
    store_problem: str | None = None
    # The step cache's work (None where nothing counted it); seconds from the first transformer call to the last
    # step's end, less the compile (None: no step ran); the pipeline's weight bytes (this rank's, sharded).
    cache: CacheUse | None = None
    denoise_seconds: float | None = None
    weight_bytes: int = 0
    # Seconds rank 0 had a collective in flight (launch to completion, waits included), when the call was profiled.
    collective_seconds: float | None = None
    # The GPU lent for this call (ZeroGPU), None on a device this host holds.
    gpu_lease: GpuLease | None = None


@dataclass(frozen=True)
class GenerateResult:
    """A finished request: the images and the facts a person wants to see beside them."""

    request: Request
    key: PipelineKey
    images: list
    seconds: float
    queue_wait: float
    load_seconds: float
    compile_seconds: float
    new_graphs: int
    warm: bool
    compile_cache_hits: int = 0
    step_seconds: list[float] = field(default_factory=list)
    preview_seconds: float = 0.0
    # Words of the prompt the model was not trained on, and the sentence that tells a person so ("" if none).
    unknown_words: tuple[str, ...] = ()
    note: str = ""
    # For a request of several images: each image's own result, in order.
    parts: tuple[GenerateResult, ...] = ()
    # The host that drew it (on a Ray cluster: host name/Ray node id), beside `device`.
    node: str = ""
    # Requests drawn in the same pipeline call, this one included, and that call's serial number (results of one
    # call share it, and its compile facts).
    batch: int = 1
    call: int = 0
    cache: CacheUse | None = None
    denoise_seconds: float | None = None
    weight_bytes: int = 0
    # Answered from the exact-result cache (ACCELDEMO_RESULT_CACHE): the images an identical request drew before.
    from_cache: bool = False
    # What happened to precompiled packages in its call (RunOutput.package_events: built, loaded, fetched, rejected,
    # and each refusal of the shared store's by its reason, e.g. bad_signature).
    package_events: dict[str, int] = field(default_factory=dict)
    gpu_lease: GpuLease | None = None

    @property
    def image(self):
        return self.images[0]

    @staticmethod
    def of_images(request: Request, parts: list[GenerateResult]) -> GenerateResult:
        """The result of a request of several images from each image's: the images in order, the slowest image's
        times, graphs and compile seconds summed, warm when every image was."""
        if len(parts) == 1 and parts[0].request is request:
            return parts[0]
        first = parts[0]
        calls = list({p.call: p for p in parts}.values()) if all(p.call for p in parts) else parts  # each call once
        return GenerateResult(
            request=request, key=first.key, images=[image for part in parts for image in part.images],
            seconds=max(p.seconds for p in parts), queue_wait=max(p.queue_wait for p in parts),
            load_seconds=max(p.load_seconds for p in parts), compile_seconds=sum(p.compile_seconds for p in calls),
            new_graphs=sum(p.new_graphs for p in calls), warm=all(p.warm for p in parts),
            compile_cache_hits=sum(p.compile_cache_hits for p in calls), step_seconds=first.step_seconds,
            preview_seconds=sum(p.preview_seconds for p in calls),
            unknown_words=first.unknown_words, note=first.note, parts=tuple(parts), node=first.node,
            batch=max(p.batch for p in parts), call=first.call, cache=first.cache,
            denoise_seconds=first.denoise_seconds, weight_bytes=first.weight_bytes,
            from_cache=all(p.from_cache for p in parts),
            package_events=dict(sum((Counter(p.package_events) for p in calls), Counter())),
            gpu_lease=first.gpu_lease)

    def facts(self, image: int = 0) -> dict[str, Any]:
        """The result as plain JSON-able values (for CLI --json, the HTTP API and logs); for a request of several
        images, those of `image` (its seed, its device, its times)."""
        if self.parts:
            return {**self.parts[image].facts(), "num_images": self.request.num_images}
        r = self.request
        return {
            "model": r.model, "hardware": r.hardware, "mode": str(r.mode), "placement": str(r.placement),
            "tp_size": r.tp_size, "cp_size": r.cp_size, "world_size": r.world_size, "width": r.width,
            "height": r.height, "steps": r.steps,
            "guidance": r.guidance, "seed": r.seed, "num_images": r.num_images, "quality": r.quality,
            "seconds": round(self.seconds, 4), "queue_wait": round(self.queue_wait, 4),
            "load_seconds": round(self.load_seconds, 4),
            "compile_seconds": round(self.compile_seconds, 4), "new_graphs": self.new_graphs,
            "compile_cache_hits": self.compile_cache_hits, "warm": self.warm,
            "preview_seconds": round(self.preview_seconds, 4),
            "device": str(self.key.devices or self.key.hardware), "node": self.node,
            "unknown_words": list(self.unknown_words), "note": self.note, "batch": self.batch,
            "edit": r.edit.facts() if r.edit else None, "lora": r.lora,
            "lora_scale": r.lora_scale if r.lora else None,
            "step_cache": {"asked": r.step_cache_asked or "none", "why": r.step_cache_why or None,
                           **(self.cache or CacheUse(str(r.step_cache) if r.step_cache else None, 0, 0)).facts()},
            "quantization": str(r.quantization), "weight_bytes": self.weight_bytes,
            "denoise_seconds": None if self.denoise_seconds is None else round(self.denoise_seconds, 4),
            "from_cache": self.from_cache, "packages": dict(self.package_events),
            "zero_gpu": self.gpu_lease.facts() if self.gpu_lease else None,
        }
