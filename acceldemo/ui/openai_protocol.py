"""OpenAI's Images API as this app speaks it: the request bodies (pydantic models, the edit form), the encodings,
and every failure mapped to OpenAI's error shape and the status a client expects, in one place. The routes that use
them: `openai_api`."""
from __future__ import annotations

import io
import logging
import math
from typing import ClassVar, Literal

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException

from ..engine import MAX_IMAGES
from ..engine.pictures import MAX_IMAGE_BYTES
from ..errors import (
    AcceldemoError,
    Cancelled,
    CapacityExceeded,
    DeviceBusy,
    GpuQuotaExceeded,
    HardwareUnavailable,
    InvalidRequest,
    ModelUnavailable,
    QueueFull,
    UnknownName,
    UnsupportedCombination,
    describe_error,
)
from ..records import EditMethod, GenerateParams
from ..records import Request as EngineRequest
from .keys import MAX_USER_CHARS

log = logging.getLogger("acceldemo.api")
PREFIX = "/v1"
# What Retry-After says when a device stayed busy past ACCELDEMO_DEVICE_WAIT_S (a full line says its own expected
# wait): jobs on the tiny models take well under a second, a real model's a few seconds.
RETRY_AFTER_S = 2
# What it says while the start-up warm-up compiles: a compile takes seconds to minutes.
WARMING_RETRY_AFTER_S = 10
# How often a request whose images are being made checks that its client is still connected.
DISCONNECT_POLL_S = 0.25
# The engine's field names where the API's differ: its errors name the engine's field, clients know the API's.
API_NAMES = {"resolution": "size", "width": "size", "height": "size", "steps": "num_inference_steps",
             "guidance": "guidance_scale", "num_images": "n"}


# Our own stream event: each phase of each image as it advances (OpenAI's stream has partial and completed images).
PROGRESS_EVENT = "acceldemo.progress"
# OpenAI's completed event counts tokens of its own models; a diffusion pipeline here counts none.
NO_USAGE = {"input_tokens": 0, "input_tokens_details": {"image_tokens": 0, "text_tokens": 0}, "output_tokens": 0,
            "total_tokens": 0}
# Still image formats this server encodes (OpenAI's gif and svg outputs are not drawn by a diffusion pipeline).
FORMATS = {"png": ("PNG", "image/png"), "jpeg": ("JPEG", "image/jpeg"), "webp": ("WEBP", "image/webp")}


class ImageGenerationRequest(BaseModel):
    """POST /v1/images/generations: every field of OpenAI's `images.generate`; the extensions SGLang-Diffusion and
    vLLM-Omni also take under these names (seed, num_inference_steps, guidance_scale); and ours (hardware, mode,
    placement, tp_size). Types are checked here, values by the engine, as for every front end; what an OpenAI field
    changes here, or why it changes nothing, is in each image's facts (`options`)."""

    model_config = ConfigDict(extra="forbid")

    prompt: str
    # A catalog name (GET /v1/models); absent: the operator's default model.
    model: str | None = None
    # Images of one engine request, each with its own seed: seed, seed+1, ...
    n: int = Field(1, ge=1, le=MAX_IMAGES)
    # WIDTHxHEIGHT; absent or "auto": the model's default size.
    size: str | None = None
    response_format: Literal["b64_json", "url"] = "b64_json"
    # low, medium, high (xhigh, max), standard, hd, auto: the model's steps preset (the engine checks the name).
    quality: str | None = None
    # DALL-E 3's vivid or natural: no model here has a style preset.
    style: Literal["vivid", "natural"] | None = None
    # transparent (only where the model draws alpha: the engine refuses it otherwise), opaque, auto.
    background: str | None = None
    moderation: Literal["low", "auto"] | None = None
    output_format: Literal["png", "jpeg", "webp", "gif", "svg"] | None = None
    # jpeg and webp's quality, 0-100 (OpenAI's default 100).
    output_compression: int | None = Field(None, ge=0, le=100)
    # Previews of the image as it forms, as stream events (0-3, as OpenAI).
    partial_images: int | None = Field(None, ge=0, le=3)
    complexity: Literal["low", "medium", "high"] | None = None
    # GIF and SVG outputs' own fields: refused with their formats.
    frame_count: int | None = None
    frame_duration_ms: int | None = None
    svg: dict | None = None
    # OpenAI's end-user ids: with a client key, the client within that key whose turn in line it is (keys.py).
    user: str | None = Field(None, max_length=MAX_USER_CHARS)
    safety_identifier: str | None = Field(None, max_length=MAX_USER_CHARS)
    # Server-sent events as the images advance (each phase, then each image) instead of one JSON answer.
    stream: bool = False
    seed: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    hardware: str | None = None
    mode: str | None = None
    placement: str | None = None
    tp_size: int | None = None
    # Context-parallel degree with placement cp.
    cp_size: int | None = None
    # A LoRA style of the model (GET /v1/models lists each model's `loras`) and its strength (0-2).
    lora: str | None = None
    lora_scale: float | None = None
    # A step cache (none, auto, or one GET /v1/models lists under `step_caches`) and the weights' quantization
    # (none, int8, fp8).
    step_cache: str | None = None
    quantization: str | None = None

    # The stream's event names: image_generation.partial_image, image_generation.completed.
    stream_kind: ClassVar[str] = "image_generation"

    @property
    def format(self) -> str:
        return self.output_format or "png"

    @property
    def partials(self) -> int:
        """Partial images to send: asked for, and only in a stream (as OpenAI)."""
        return (self.partial_images or 0) if self.stream else 0

    def params(self) -> GenerateParams:
        """The engine's raw request: a field left out keeps the engine's default (a seed left out is drawn at random,
        as OpenAI's API gives other images for the same prompt each time; the facts say which). Fields no engine
        value stands for are refused here by name."""
        if self.output_format in ("gif", "svg"):
            raise InvalidRequest("output_format", self.output_format, "png, jpeg or webp: a diffusion pipeline draws "
                                                                      "one still raster image")
        for name in ("frame_count", "frame_duration_ms", "svg"):
            if getattr(self, name) is not None:
                raise InvalidRequest(name, getattr(self, name), f"left out: it belongs to output_format "
                                                                f"{'svg' if name == 'svg' else 'gif'}, which this "
                                                                "server does not draw")
        return GenerateParams(
            prompt=self.prompt, model=self.model, hardware=self.hardware, mode=self.mode, placement=self.placement,
            tp_size=self.tp_size, cp_size=self.cp_size, resolution=None if self.size == "auto" else self.size,
            steps=self.num_inference_steps, guidance=self.guidance_scale, seed=self.seed, num_images=self.n,
            quality=self.quality, background=self.background, previews=self.partials > 0, lora=self.lora,
            lora_scale=self.lora_scale, step_cache=self.step_cache, quantization=self.quantization,
            **self.pictures())

    def pictures(self) -> dict:
        return {}

    def options(self, request: EngineRequest) -> dict[str, dict[str, str]]:
        """What each OpenAI option given did here: `honoured` (and how), `ignored` (and why)."""
        honoured, ignored = {}, {}
        if self.quality is not None:
            if self.num_inference_steps is not None:
                ignored["quality"] = f"{self.quality}: num_inference_steps={self.num_inference_steps} was given"
            else:
                honoured["quality"] = f"{self.quality}: {request.steps} steps ({request.model}'s preset)"
        if self.output_format is not None:
            honoured["output_format"] = self.output_format
        if self.output_compression is not None:
            if self.format == "png":
                ignored["output_compression"] = f"{self.output_compression}: png is lossless"
            else:
                honoured["output_compression"] = f"{self.output_compression}: {self.format} quality"
        if self.background is not None:
            honoured["background"] = f"{self.background}: {request.model} draws opaque images"
        if self.partial_images is not None:
            if self.stream:
                honoured["partial_images"] = f"{self.partial_images}: previews decoded from the latents"
            else:
                ignored["partial_images"] = f"{self.partial_images}: partial images come only with stream=true"
        for name, why in (("style", "no model here has a style preset"),
                          ("moderation", "this server moderates nothing"),
                          ("complexity", "no model here plans before it draws"),
                          ("user", "end-user ids are not kept (with a client key, it takes turns in line)"),
                          ("safety_identifier", "end-user ids are not kept (with a client key, it takes turns in "
                                                "line)")):
            if getattr(self, name) is not None:
                ignored[name] = f"{getattr(self, name)}: {why}"
        return {"honoured": honoured, "ignored": ignored}


class ImageEditRequest(ImageGenerationRequest):
    """POST /v1/images/edits (multipart form): OpenAI's `images.edit` — one picture or several (`image`/`image[]`,
    reference images where the model edits with them), an optional `mask` (PNG, transparent where the picture
    changes; only models that inpaint take one) — every field of `images.generate` above, and `strength` (0-1] for
    models that edit by image-to-image. The files are checked by the engine (format, bytes, pixels)."""

    image: list[bytes]
    mask: bytes | None = None
    strength: float | None = None
    # OpenAI's fidelity to the input's faces and details (gpt-image-1): accepted, nothing here stands for it.
    input_fidelity: Literal["low", "high"] | None = None

    stream_kind: ClassVar[str] = "image_edit"

    def pictures(self) -> dict:
        return {"image": self.image, "mask": self.mask, "strength": self.strength}

    def options(self, request: EngineRequest) -> dict[str, dict[str, str]]:
        told = super().options(request)
        if self.input_fidelity is not None:
            told["ignored"]["input_fidelity"] = f"{self.input_fidelity}: no model here has a fidelity setting"
        if self.strength is not None and request.edit and request.edit.method == EditMethod.REFERENCE:
            told["ignored"]["strength"] = f"{self.strength}: {request.model} edits with reference images"
        return told


# What one uploaded file may be at most (the engine states the picture limits; this only stops reading).
MAX_UPLOAD_BYTES = MAX_IMAGE_BYTES + 1


async def edit_form(request: Request) -> ImageEditRequest:
    """The multipart form as an edit request: files read (at most one byte past the engine's limit, so that it
    refuses them by size), text fields typed by the model like JSON fields."""
    from starlette.datastructures import UploadFile

    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise InvalidRequest("image", "a request that is not multipart/form-data", "the picture as a file part of a "
                                                                                    "multipart/form-data body")
    async with request.form(max_files=16, max_fields=64) as form:
        fields: dict = {}
        for name, value in form.multi_items():
            key = name.removesuffix("[]")
            if isinstance(value, UploadFile):
                value = await value.read(MAX_UPLOAD_BYTES)
            if key == "image":
                fields.setdefault("image", []).append(value if isinstance(value, bytes) else value.encode())
            elif key == "mask" and isinstance(value, str):
                fields["mask"] = value.encode()
            else:
                fields[key] = value
    if not fields.get("image"):
        raise InvalidRequest("image", "no file", "one picture (or several) as the form's image file(s)")
    return ImageEditRequest.model_validate(fields)


def partial_steps(total: int, wanted: int) -> list[int]:
    """The denoise steps whose previews become OpenAI's partial images: `wanted` of them spread evenly over the
    steps, before the last (fewer when there are fewer steps: OpenAI may also send fewer than asked)."""
    return sorted({max(1, math.ceil(k * total / (wanted + 1))) for k in range(1, wanted + 1)})


def encode(image, output_format: str, compression: int | None = None) -> bytes:
    """The image in one of FORMATS; jpeg and webp at quality `compression` (OpenAI's default 100)."""
    out = io.BytesIO()
    pil_format, _ = FORMATS[output_format]
    lossy = {} if output_format == "png" else {"quality": 100 if compression is None else compression}
    image.convert("RGB").save(out, format=pil_format, **lossy)
    return out.getvalue()


class ApiError(Exception):
    """An answer in OpenAI's error shape, with its HTTP status (and Retry-After where trying again helps)."""

    def __init__(self, status: int, message: str, kind: str, code: str, param: str | None = None,
                 retry_after: int | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param = status, message, kind, code, param
        self.headers = dict(headers or {})
        if retry_after is not None:
            self.headers["Retry-After"] = str(retry_after)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def api_error(error: BaseException) -> ApiError:
    """Any failure of a /v1 request as OpenAI's error: the status a client expects, the message the page and the CLI
    show for the same request, and `param` the API's name of the field at fault."""
    if isinstance(error, ApiError):
        return error
    if isinstance(error, ValidationError):
        param, message = _body_problem(error)
        return ApiError(400, message, "invalid_request_error", "invalid_value", param)
    if isinstance(error, HTTPException):  # the keys (401, 403) and routing (405) of the /v1 routes
        code = {401: "invalid_api_key", 403: "insufficient_permissions",
                405: "method_not_allowed"}.get(error.status_code, "http_error")
        return ApiError(error.status_code, str(error.detail), "invalid_request_error" if error.status_code < 500
                        else "server_error", code, headers=error.headers)
    if not isinstance(error, AcceldemoError):  # a bug of ours: a message, never a traceback or a dead server
        log.error("/v1 request failed", exc_info=error)
        return ApiError(500, f"internal error: {describe_error(error)}", "server_error", "internal_error")
    message, param = str(error), API_NAMES.get(error.field, error.field)
    if isinstance(error, UnknownName) and error.field == "model":
        return ApiError(404, message, "invalid_request_error", "model_not_found", "model")
    if isinstance(error, ModelUnavailable):  # in the catalog, but its weights are not on this host
        return ApiError(404, message, "invalid_request_error", "model_not_available", "model")
    if isinstance(error, InvalidRequest):
        return ApiError(400, message, "invalid_request_error", "invalid_value", param)
    if isinstance(error, UnsupportedCombination):
        return ApiError(400, message, "invalid_request_error", "unsupported_combination", param)
    if isinstance(error, HardwareUnavailable):
        return ApiError(400, message, "invalid_request_error", "hardware_unavailable", param)
    if isinstance(error, QueueFull):
        return ApiError(429, message, "rate_limit_error", "queue_full", retry_after=error.retry_after_s or 1)
    if isinstance(error, GpuQuotaExceeded):
        return ApiError(429, message, "rate_limit_error", "gpu_quota_exceeded", retry_after=error.retry_after_s)
    if isinstance(error, DeviceBusy):
        return ApiError(503, message, "server_error", "device_busy", retry_after=RETRY_AFTER_S)
    if isinstance(error, CapacityExceeded):  # a new size past ACCELDEMO_MAX_SHAPES: the message lists those that work
        return ApiError(400, message, "invalid_request_error", "limit_exceeded", "size")
    if isinstance(error, Cancelled):  # only a client that went away stops an API request: nobody reads this one
        return ApiError(499, message, "request_cancelled", "client_closed_request")
    return ApiError(500, message, "server_error", "generation_failed")


def _body_problem(error: ValidationError) -> tuple[str | None, str]:
    """The first thing wrong with a request body, named as the engine names a bad value."""
    problem = error.errors(include_url=False)[0]
    param = ".".join(str(part) for part in problem["loc"]) or None
    problem_type = problem["type"]  # pydantic's name for what is wrong
    if problem_type == "json_invalid":
        return None, f"the body is not valid JSON: {problem.get('ctx', {}).get('error', problem['msg'])}"
    if problem_type in ("model_type", "model_attributes_type"):
        return None, "the body must be a JSON object"
    if problem_type == "missing":
        return param, f"{param} is required"
    if problem_type == "extra_forbidden":
        accepted = ", ".join(ImageGenerationRequest.model_fields)
        return param, str(InvalidRequest(param, problem["input"], f"unknown field; accepted fields are {accepted}"))
    return param, str(InvalidRequest(param, problem["input"], problem["msg"][0].lower() + problem["msg"][1:]))
