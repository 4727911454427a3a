"""The OpenAI-compatible Images API beside the page (/v1): OpenAI's request and response shapes translated to and from
engine calls, and every failure mapped to OpenAI's error shape and the status a client expects, in one place."""
from __future__ import annotations

import base64
import io
import json
import logging
import math
import secrets
import shutil
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import ClassVar, Literal

from fastapi import APIRouter, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from ..engine import MAX_IMAGES, Engine, ModelView
from ..engine.pictures import MAX_IMAGE_BYTES
from ..errors import (
    AcceldemoError,
    Cancelled,
    CapacityExceeded,
    DeviceBusy,
    HardwareUnavailable,
    InvalidRequest,
    ModelUnavailable,
    QueueFull,
    UnknownName,
    UnsupportedCombination,
    describe_error,
)
from ..models.catalog import CATALOG
from ..records import EditMethod, GenerateParams, GenerateResult, Progress
from ..records import Request as EngineRequest
from .watch import WatchedJob

log = logging.getLogger("acceldemo.api")
PREFIX = "/v1"
# How long an image answered as a URL stays served.
IMAGE_TTL_S = 3600
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
    # OpenAI's end-user ids: accepted and ignored.
    user: str | None = None
    safety_identifier: str | None = None
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
                          ("user", "end-user ids are not kept"), ("safety_identifier", "end-user ids are not kept")):
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
    if isinstance(error, HTTPException):  # the token guard (401) and routing (405) of the /v1 routes
        code = {401: "invalid_api_key", 405: "method_not_allowed"}.get(error.status_code, "http_error")
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


class ImageStore:
    """The images answered as URLs: files in a private (0700) folder of this app, each served for `ttl_s` seconds
    under a random 128-bit id; expired ones are deleted as the store is used, the folder when the app ends."""

    def __init__(self, ttl_s: float = IMAGE_TTL_S, parent: str | None = None):
        self.ttl_s = ttl_s
        self.folder = Path(tempfile.mkdtemp(prefix="v1-images-", dir=parent))
        # id -> (expiry, format), in the order they were added, so also the order they expire
        self._kept: dict[str, tuple[float, str]] = {}
        self._lock = threading.Lock()

    def put(self, data: bytes, output_format: str = "png") -> str:
        key = secrets.token_urlsafe(16)
        (self.folder / f"{key}.{output_format}").write_bytes(data)
        with self._lock:
            self._purge()
            self._kept[key] = (time.monotonic() + self.ttl_s, output_format)
        return key

    def get(self, key: str) -> bytes | None:
        """The image's bytes while it is served; None for an unknown or expired id."""
        found = self.find(key)
        return found[0] if found else None

    def find(self, key: str) -> tuple[bytes, str] | None:
        """The image's bytes and format while it is served; None for an unknown or expired id."""
        with self._lock:
            self._purge()
            if key not in self._kept:
                return None
            output_format = self._kept[key][1]
        try:
            return (self.folder / f"{key}.{output_format}").read_bytes(), output_format
        except FileNotFoundError:  # expired and deleted by another request in between
            return None

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)

    def _purge(self) -> None:
        now = time.monotonic()
        while self._kept:
            key, (expiry, output_format) = next(iter(self._kept.items()))
            if expiry > now:
                return
            del self._kept[key]
            (self.folder / f"{key}.{output_format}").unlink(missing_ok=True)


def openai_router(engine: Engine, images: ImageStore, dependencies: Sequence = ()) -> APIRouter:
    """The /v1 routes; `dependencies` guard them all (the bearer token when ACCELDEMO_API_TOKEN is set), and
    generation answers 503 until the engine's start-up warm-up is done.

    A generation is admitted into the engine's line (or refused) as soon as its body is read, on the event loop:
    nothing of this route waits in front of the line."""
    router = APIRouter(prefix=PREFIX, dependencies=list(dependencies))
    listed_since = int(time.time())

    def image_data(request: Request, asked: ImageGenerationRequest, image: str) -> dict:
        """One image as OpenAI's data item: base64 bytes in the asked format, or the absolute URL of this app's copy."""
        link = str(request.url_for("openai_image", image_id=image)) if asked.response_format == "url" else image
        return {asked.response_format: link, "revised_prompt": None}

    def encoded(result: GenerateResult, asked: ImageGenerationRequest) -> list[str]:
        """Each image of the result in the asked format: its id in the store (answered as a URL), or base64."""
        made = [encode(image, asked.format, asked.output_compression) for image in result.images]
        if asked.response_format == "url":
            return [images.put(data, asked.format) for data in made]
        return [base64.b64encode(data).decode() for data in made]

    def facts(result: GenerateResult, asked: ImageGenerationRequest, image: int) -> dict:
        return {**result.facts(image), "options": asked.options(result.request)}

    @router.post("/images/generations")
    async def generations(request: Request) -> Response:
        async def read() -> ImageGenerationRequest:
            return ImageGenerationRequest.model_validate_json(await request.body())

        return await answer(request, read)

    @router.post("/images/edits")
    async def edits(request: Request) -> Response:
        return await answer(request, lambda: edit_form(request))

    async def answer(request: Request, read) -> Response:
        try:
            startup = engine.startup
            if not startup.ready:
                raise ApiError(503, f"the app is still warming up ({startup.shown}); /ready answers 200 once it is "
                                    "done", "server_error", "warming_up", retry_after=WARMING_RETRY_AFTER_S)
            asked = await read()
            checked = await run_in_threadpool(engine.check, asked.params())
            job = WatchedJob(lambda report: engine.submit(checked, report))
            if asked.stream:
                return stream(job, asked, request)
            result = await finished(job, request)
        except Exception as error:
            return api_error(error).response()
        made = await run_in_threadpool(encoded, result, asked)
        return JSONResponse({"created": int(time.time()), "output_format": asked.format,
                             "background": "opaque", "quality": asked.quality or "auto",
                             "data": [image_data(request, asked, image) for image in made],
                             "size": str(result.request.shape),
                             "acceldemo": [facts(result, asked, i) for i in range(len(made))]},
                            headers=_fact_headers(result))

    async def finished(job: WatchedJob, client: Request) -> GenerateResult:
        """The job's result; a client that goes away stops it (at its next step, or out of the line)."""
        async for _ in job.events(DISCONNECT_POLL_S):
            if await client.is_disconnected():
                job.cancel()
        return await job.result()

    def stream(job: WatchedJob, asked: ImageGenerationRequest, client: Request) -> StreamingResponse:
        """Server-sent events as the images advance: ours per phase (in line, loading, compiling WxH, denoise step
        i/n, decoding), OpenAI's `image_generation.partial_image` for the previews asked for (`partial_images`), then
        OpenAI's `image_generation.completed` for each image. A request refused (invalid, line full) was answered
        with its error status before the stream starts; after it, a failure is an `error` event, which ends it."""
        request = job.job.request
        wanted = partial_steps(request.steps, asked.partials)
        sent: dict[int, int] = {}  # partial images sent, per image of the request
        shown = {"background": "opaque", "output_format": asked.format, "quality": asked.quality or "auto",
                 "size": str(request.shape)}

        def event(name: str, data: dict) -> str:
            return f"event: {name}\ndata: {json.dumps(data)}\n\n"

        def progress(value: Progress) -> str:
            return event(PROGRESS_EVENT, {
                "type": PROGRESS_EVENT, "index": value.image, "phase": str(value.phase), "message": value.message,
                "step": value.step, "total": value.total, "elapsed": round(value.elapsed, 4),
                "expected": None if value.expected is None else round(value.expected, 1),
                "preview": value.preview is not None})

        def partial(value: Progress) -> str | None:
            """OpenAI's partial image for a preview at one of the `wanted` steps (or the first after it)."""
            count = sent.get(value.image, 0)
            if value.preview is None or count >= len(wanted) or value.preview.step < wanted[count]:
                return None
            sent[value.image] = count + sum(1 for step in wanted[count:] if step <= value.preview.step)
            data = encode(value.preview.image(), asked.format, asked.output_compression)
            return event(f"{asked.stream_kind}.partial_image", {
                "type": f"{asked.stream_kind}.partial_image", "b64_json": base64.b64encode(data).decode(),
                "partial_image_index": count, "created_at": int(time.time()), **shown, "index": value.image})

        async def sent_events() -> AsyncIterator[str]:
            try:
                async for value in job.events(DISCONNECT_POLL_S):
                    if value is None:
                        if await client.is_disconnected():
                            job.cancel()
                        continue
                    yield progress(value)
                    if value.preview is not None and wanted:
                        picture = await run_in_threadpool(partial, value)
                        if picture:
                            yield picture
                try:
                    result = await job.result()
                except Exception as error:
                    yield event("error", api_error(error).body())
                    return
                made = await run_in_threadpool(encoded, result, asked)
                for i, image in enumerate(made):
                    yield event(f"{asked.stream_kind}.completed", {
                        "type": f"{asked.stream_kind}.completed", **image_data(client, asked, image),
                        "created_at": int(time.time()), **shown, "usage": NO_USAGE, "index": i,
                        "acceldemo": facts(result, asked, i)})
            finally:  # also when the client went away and the server stopped sending
                job.cancel()

        return StreamingResponse(sent_events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @router.get("/images/{image_id}", name="openai_image")
    def image(image_id: str) -> Response:
        found = images.find(image_id)
        if found is None:
            return ApiError(404, f"no image {image_id!r}: images are served for {IMAGE_TTL_S // 60} minutes after "
                                 "they are made, and not after the app restarts", "invalid_request_error",
                            "image_not_found", "image_id").response()
        data, output_format = found
        return Response(data, media_type=FORMATS[output_format][1])

    @router.get("/models")
    def models() -> dict:
        return {"object": "list", "data": [_model_entry(m, listed_since) for m in engine.describe().models]}

    @router.get("/models/{name:path}")
    def model(name: str) -> Response:
        if name not in CATALOG:
            return api_error(UnknownName("model", name, CATALOG)).response()
        return JSONResponse(_model_entry(engine.describe().model(name), listed_since))

    return router


def _model_entry(model: ModelView, created: int) -> dict:
    """A catalog model in OpenAI's model shape, with whether it can run here and what a request gets by default."""
    return {"id": model.name, "object": "model", "created": created, "owned_by": "acceldemo", "title": model.title,
            "available": model.available, "availability": model.availability, "default": model.default,
            "size": str(model.default_size), "sizes": [str(s) for s in model.presets],
            "num_inference_steps": model.steps, "guidance_scale": model.guidance, "loras": list(model.loras),
            "edits": {"method": model.edits, "mask": model.inpaints}, "step_caches": list(model.step_caches),
            "step_cache_auto": model.cache_advice}


def _fact_headers(result: GenerateResult) -> dict[str, str]:
    """The request's facts at a glance (curl -i, proxies' logs)."""
    facts = result.facts()
    return {"X-Acceldemo-Model": result.request.model, "X-Acceldemo-Device": facts["device"],
            "X-Acceldemo-Seconds": f"{result.seconds:.4f}",
            "X-Acceldemo-Compile-Seconds": f"{result.compile_seconds:.4f}",
            "X-Acceldemo-New-Graphs": str(result.new_graphs), "X-Acceldemo-Warm": "true" if result.warm else "false"}


async def openai_http_error(request: Request, error: HTTPException) -> Response:
    """FastAPI's own HTTP errors (the token guard, a wrong method) in OpenAI's shape under /v1, unchanged elsewhere."""
    if request.url.path.startswith(PREFIX + "/"):
        return api_error(error).response()
    return await http_exception_handler(request, error)
