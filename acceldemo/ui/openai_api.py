"""The OpenAI-compatible Images API beside the page (/v1): OpenAI's request and response shapes translated to and from
engine calls, and every failure mapped to OpenAI's error shape and the status a client expects, in one place."""
from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
import secrets
import shutil
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException

from ..engine import MAX_IMAGES, MAX_SEED, SessionManager
from ..errors import (AcceldemoError, Cancelled, CapacityExceeded, DeviceBusy, HardwareUnavailable, InvalidRequest,
                      ModelUnavailable, QueueFull, UnknownName, UnsupportedCombination, describe_error)
from ..models.catalog import CATALOG
from ..models.loading import model_availability
from ..records import GenerateRequest, GenerateResult, no_progress

log = logging.getLogger("acceldemo.api")
PREFIX = "/v1"
# How long an image answered as a URL stays served.
IMAGE_TTL_S = 3600
# What Retry-After says when the line is full or a device stayed busy: jobs on the tiny models take well under a
# second, a real model's a few seconds, and a client that retries sooner is refused again at no cost to anyone.
RETRY_AFTER_S = 2
# What it says while the start-up warm-up compiles: a compile takes seconds to minutes.
WARMING_RETRY_AFTER_S = 10
# How often a request whose images are being made checks that its client is still connected.
DISCONNECT_POLL_S = 0.25
# The engine's field names where the API's differ: its errors name the engine's field, clients know the API's.
API_NAMES = {"resolution": "size", "width": "size", "height": "size", "steps": "num_inference_steps",
             "guidance": "guidance_scale", "num_images": "n"}


class ImageGenerationRequest(BaseModel):
    """POST /v1/images/generations: OpenAI's fields; the extensions SGLang-Diffusion and vLLM-Omni also take under
    these names (seed, num_inference_steps, guidance_scale); and ours (hardware, mode, placement, tp_size). Types are
    checked here, values by the engine, as for every front end."""

    model_config = ConfigDict(extra="forbid")

    prompt: str
    # A catalog name (GET /v1/models); absent: the operator's default model.
    model: str | None = None
    # Images, each its own engine request with its own seed: seed, seed+1, ...
    n: int = Field(1, ge=1, le=MAX_IMAGES)
    # WIDTHxHEIGHT; absent or "auto": the model's default size.
    size: str | None = None
    response_format: Literal["b64_json", "url"] = "b64_json"
    # OpenAI's end-user id: accepted and ignored.
    user: str | None = None
    # Server-sent events as the images advance (each phase, then each image) instead of one JSON answer.
    stream: bool = False
    seed: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    hardware: str | None = None
    mode: str | None = None
    placement: str | None = None
    tp_size: int | None = None

    def engine_requests(self) -> list[GenerateRequest]:
        """One engine request per image; a field left out keeps the engine's default, but for `seed`: absent, it is
        drawn at random, as OpenAI's API gives other images for the same prompt each time (the facts say which)."""
        seed = secrets.randbelow(MAX_SEED - self.n + 2) if self.seed is None else self.seed
        given = {"prompt": self.prompt, "model": self.model, "hardware": self.hardware, "mode": self.mode,
                 "placement": self.placement, "tp_size": self.tp_size,
                 "resolution": None if self.size == "auto" else self.size, "steps": self.num_inference_steps,
                 "guidance": self.guidance_scale, "seed": seed}
        first = GenerateRequest(**{name: value for name, value in given.items() if value is not None})
        return [replace(first, seed=first.seed + i) for i in range(self.n)]


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
        return ApiError(429, message, "rate_limit_error", "queue_full", retry_after=RETRY_AFTER_S)
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
    kind = problem["type"]
    if kind == "json_invalid":
        return None, f"the body is not valid JSON: {problem.get('ctx', {}).get('error', problem['msg'])}"
    if kind in ("model_type", "model_attributes_type"):
        return None, "the body must be a JSON object"
    if kind == "missing":
        return param, f"{param} is required"
    if kind == "extra_forbidden":
        accepted = ", ".join(ImageGenerationRequest.model_fields)
        return param, str(InvalidRequest(param, problem["input"], f"unknown field; accepted fields are {accepted}"))
    return param, str(InvalidRequest(param, problem["input"], problem["msg"][0].lower() + problem["msg"][1:]))


def png(image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="png")
    return out.getvalue()


class ImageStore:
    """The PNGs answered as URLs: files in a private (0700) folder of this app, each served for `ttl_s` seconds under
    a random 128-bit id; expired ones are deleted as the store is used, the folder when the app ends."""

    def __init__(self, ttl_s: float = IMAGE_TTL_S, parent: str | None = None):
        self.ttl_s = ttl_s
        self.folder = Path(tempfile.mkdtemp(prefix="v1-images-", dir=parent))
        self._expiry: dict[str, float] = {}  # in the order they were added, so also the order they expire
        self._lock = threading.Lock()

    def put(self, data: bytes) -> str:
        key = secrets.token_urlsafe(16)
        (self.folder / f"{key}.png").write_bytes(data)
        with self._lock:
            self._purge()
            self._expiry[key] = time.monotonic() + self.ttl_s
        return key

    def get(self, key: str) -> bytes | None:
        """The image's PNG while it is served; None for an unknown or expired id."""
        with self._lock:
            self._purge()
            if key not in self._expiry:
                return None
        try:
            return (self.folder / f"{key}.png").read_bytes()
        except FileNotFoundError:  # expired and deleted by another request in between
            return None

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)

    def _purge(self) -> None:
        now = time.monotonic()
        while self._expiry:
            key, expiry = next(iter(self._expiry.items()))
            if expiry > now:
                return
            del self._expiry[key]
            (self.folder / f"{key}.png").unlink(missing_ok=True)


class ImageJob:
    """The images of one request, made side by side, each one engine call in a thread of the route's pool. What
    happens to them (their progress when asked for, each image, each failure) comes back as events on the event
    loop. The first failure, or a client that goes away, stops the others at their next step or takes them out of
    the line."""

    def __init__(self, manager: SessionManager, pool: ThreadPoolExecutor, store: ImageStore,
                 asked: list[GenerateRequest], as_url: bool, progress: bool):
        self._loop = asyncio.get_running_loop()
        self._events: asyncio.Queue[tuple[str, int, Any]] = asyncio.Queue()
        self._stopped = threading.Event()
        self._unfinished = len(asked)
        for i, request in enumerate(asked):
            pool.submit(self._make, manager, store, i, request, as_url, progress)

    def stop(self) -> None:
        self._stopped.set()

    async def events(self, client: Request) -> AsyncIterator[tuple[str, int, Any]]:
        """("progress", i, Progress), ("image", i, (result, b64 or image id)) and ("failed", i, error), until every
        image is made or has failed."""
        while self._unfinished:
            try:
                kind, i, value = await asyncio.wait_for(self._events.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                if await client.is_disconnected():
                    self.stop()
                continue
            if kind != "progress":
                self._unfinished -= 1
            yield kind, i, value

    async def results(self, client: Request) -> list[tuple[GenerateResult, str]]:
        """Every image, in order; or the first failure (the cause, rather than a sibling it stopped)."""
        made: list = [None] * self._unfinished
        failures: list[BaseException] = []
        async for kind, i, value in self.events(client):
            if kind == "image":
                made[i] = value
            elif kind == "failed":
                failures.append(value)
        if failures:
            raise next((f for f in failures if not isinstance(f, Cancelled)), failures[0])
        return made

    def _make(self, manager: SessionManager, store: ImageStore, i: int, request: GenerateRequest, as_url: bool,
              progress: bool) -> None:
        report = (lambda event: self._emit("progress", i, event)) if progress else no_progress
        try:
            result = manager.generate(request, report, cancelled=self._stopped.is_set)
            data = png(result.image)
            self._emit("image", i, (result, store.put(data) if as_url else base64.b64encode(data).decode()))
        except Exception as error:
            self._emit("failed", i, error)  # queued before the others can see the stop and fail in turn
            self.stop()

    def _emit(self, kind: str, i: int, value: Any) -> None:
        self._loop.call_soon_threadsafe(self._events.put_nowait, (kind, i, value))


def openai_router(manager: SessionManager, startup: dict, images: ImageStore,
                  dependencies: Sequence = ()) -> APIRouter:
    """The /v1 routes; `dependencies` guard them all (the bearer token when ACCELDEMO_API_TOKEN is set), and
    generation answers 503 until `startup` says the start-up warm-up is done."""
    router = APIRouter(prefix=PREFIX, dependencies=list(dependencies))
    # Generations block a thread each; as many may run as the engine holds (a job per device plus its line), so
    # the engine's line, not this route, decides who waits and who is refused.
    pool = ThreadPoolExecutor(max_workers=manager.capacity(), thread_name_prefix="v1-images")
    listed_since = int(time.time())

    def image_data(request: Request, response_format: str, image: str) -> dict:
        """One image as OpenAI's data item: base64 PNG, or the absolute URL where this app serves it."""
        link = str(request.url_for("openai_image", image_id=image)) if response_format == "url" else image
        return {response_format: link, "revised_prompt": None}

    @router.post("/images/generations")
    async def generations(request: Request) -> Response:
        try:
            if not startup.get("done"):
                raise ApiError(503, f"the app is still warming up ({startup.get('state')}); /ready answers 200 once "
                                    "it is done", "server_error", "warming_up", retry_after=WARMING_RETRY_AFTER_S)
            asked = ImageGenerationRequest.model_validate_json(await request.body())
            each = asked.engine_requests()
            manager.check(each[0], counted=True)  # refused once, not once per image
            job = ImageJob(manager, pool, images, each, asked.response_format == "url", progress=asked.stream)
            if asked.stream:
                return await stream(job, asked.response_format, request)
            made = await job.results(request)
        except Exception as error:
            return api_error(error).response()
        results = [result for result, _ in made]
        first = results[0].request
        return JSONResponse({"created": int(time.time()), "output_format": "png",
                             "data": [image_data(request, asked.response_format, image) for _, image in made],
                             "size": f"{first.width}x{first.height}", "acceldemo": [r.facts() for r in results]},
                            headers=_fact_headers(results))

    async def stream(job: ImageJob, response_format: str, request: Request) -> StreamingResponse:
        """Server-sent events as the images advance: one per phase (in line, loading, compiling WxH, denoise step
        i/n, decoding), then each image. Until the first event the request can still be answered with an error
        status (invalid, refused); after it, a failure is an `error` event, which ends the stream."""
        events = job.events(request)
        first = await anext(events)
        if first[0] == "failed":
            raise first[2]

        def render(kind: str, i: int, value: Any) -> str:
            if kind == "progress":
                name, data = "image_generation.progress", {
                    "type": "image_generation.progress", "index": i, "phase": value.phase, "message": value.message,
                    "step": value.step, "total": value.total, "elapsed": round(value.elapsed, 4)}
            elif kind == "image":
                result, image = value
                name, data = "image_generation.completed", {
                    "type": "image_generation.completed", "index": i, **image_data(request, response_format, image),
                    "created_at": int(time.time()), "size": f"{result.request.width}x{result.request.height}",
                    "output_format": "png", "background": "opaque", "quality": "auto", "acceldemo": result.facts()}
            else:
                name, data = "error", api_error(value).body()
            return f"event: {name}\ndata: {json.dumps(data)}\n\n"

        async def sent() -> AsyncIterator[str]:
            try:
                yield render(*first)
                async for kind, i, value in events:
                    yield render(kind, i, value)
                    if kind == "failed":
                        return
            finally:  # also when the client went away and the server stopped sending
                job.stop()

        return StreamingResponse(sent(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @router.get("/images/{image_id}", name="openai_image")
    def image(image_id: str) -> Response:
        data = images.get(image_id)
        if data is None:
            return ApiError(404, f"no image {image_id!r}: images are served for {IMAGE_TTL_S // 60} minutes after "
                                 "they are made, and not after the app restarts", "invalid_request_error",
                            "image_not_found", "image_id").response()
        return Response(data, media_type="image/png")

    @router.get("/models")
    def models() -> dict:
        return {"object": "list", "data": [_model_entry(name, manager, listed_since) for name in CATALOG]}

    @router.get("/models/{name:path}")
    def model(name: str) -> Response:
        if name not in CATALOG:
            return api_error(UnknownName("model", name, CATALOG)).response()
        return JSONResponse(_model_entry(name, manager, listed_since))

    return router


def _model_entry(name: str, manager: SessionManager, created: int) -> dict:
    """A catalog model in OpenAI's model shape, with whether it can run here and what a request gets by default."""
    spec = CATALOG[name]
    available, where = model_availability(spec, manager.settings)
    return {"id": spec.name, "object": "model", "created": created, "owned_by": "acceldemo", "title": spec.title,
            "available": available, "availability": where, "default": spec.name == manager.settings.default_model,
            "size": str(spec.default_shape), "sizes": [str(s) for s in spec.presets],
            "num_inference_steps": spec.steps, "guidance_scale": spec.guidance}


def _fact_headers(results: list[GenerateResult]) -> dict[str, str]:
    """The request's facts at a glance (curl -i, proxies' logs): its images ran side by side or one after another,
    so the slowest image's seconds are the request's time in the engine."""
    devices = dict.fromkeys(r.facts()["device"] for r in results)
    return {"X-Acceldemo-Model": results[0].request.model, "X-Acceldemo-Device": ",".join(devices),
            "X-Acceldemo-Seconds": f"{max(r.seconds for r in results):.4f}",
            "X-Acceldemo-Compile-Seconds": f"{sum(r.compile_seconds for r in results):.4f}",
            "X-Acceldemo-New-Graphs": str(sum(r.new_graphs for r in results)),
            "X-Acceldemo-Warm": "true" if all(r.warm for r in results) else "false"}


async def openai_http_error(request: Request, error: HTTPException) -> Response:
    """FastAPI's own HTTP errors (the token guard, a wrong method) in OpenAI's shape under /v1, unchanged elsewhere."""
    if request.url.path.startswith(PREFIX + "/"):
        return api_error(error).response()
    return await http_exception_handler(request, error)
