"""The OpenAI-compatible Images API beside the page (/v1): its routes, each turning OpenAI's request into one engine
call and the result (or the error) back into OpenAI's shapes (`openai_protocol`)."""
from __future__ import annotations

import base64
import json
import time
from collections.abc import AsyncIterator, Sequence

from fastapi import APIRouter, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from ..engine import Engine, ModelView
from ..errors import UnknownName
from ..models.catalog import CATALOG
from ..records import GenerateResult, Progress
from .image_store import IMAGE_TTL_S, ImageStore
from .keys import client_name, visitor_token
from .openai_protocol import (
    DISCONNECT_POLL_S,
    FORMATS,
    NO_USAGE,
    PREFIX,
    PROGRESS_EVENT,
    WARMING_RETRY_AFTER_S,
    ApiError,
    ImageGenerationRequest,
    api_error,
    edit_form,
    encode,
    partial_steps,
)
from .watch import WatchedJob


def openai_router(engine: Engine, images: ImageStore, dependencies: Sequence = ()) -> APIRouter:
    """The /v1 routes; `dependencies` guard them all (the bearer token when ACCELDEMO_API_TOKEN is set), and
    generation answers 503 until the engine's start-up warm-up is done.

    A generation is admitted into the engine's line (or refused) as soon as its body is read, on the event loop:
    nothing of this route waits in front of the line."""
    api = ImagesApi(engine, images)
    router = APIRouter(prefix=PREFIX, dependencies=list(dependencies))
    router.add_api_route("/images/generations", api.generations, methods=["POST"])
    router.add_api_route("/images/edits", api.edits, methods=["POST"])
    router.add_api_route("/images/{image_id}", api.image, methods=["GET"], name="openai_image")
    router.add_api_route("/models", api.models, methods=["GET"])
    router.add_api_route("/models/{name:path}", api.model, methods=["GET"])
    return router


class ImagesApi:
    """What each /v1 route does, over one engine and the store of images answered as URLs."""

    def __init__(self, engine: Engine, images: ImageStore):
        self.engine, self.images = engine, images
        self.listed_since = int(time.time())

    async def generations(self, request: Request) -> Response:
        async def read() -> ImageGenerationRequest:
            return ImageGenerationRequest.model_validate_json(await request.body())

        return await self.answer(request, read)

    async def edits(self, request: Request) -> Response:
        return await self.answer(request, lambda: edit_form(request))

    def image_data(self, request: Request, asked: ImageGenerationRequest, image: str) -> dict:
        """One image as OpenAI's data item: base64 bytes in the asked format, or the absolute URL of this app's copy."""
        link = str(request.url_for("openai_image", image_id=image)) if asked.response_format == "url" else image
        return {asked.response_format: link, "revised_prompt": None}

    def encoded(self, result: GenerateResult, asked: ImageGenerationRequest) -> list[str]:
        """Each image of the result in the asked format: its id in the store (answered as a URL), or base64."""
        made = [encode(image, asked.format, asked.output_compression) for image in result.images]
        if asked.response_format == "url":
            return [self.images.put(data, asked.format) for data in made]
        return [base64.b64encode(data).decode() for data in made]

    @staticmethod
    def facts(result: GenerateResult, asked: ImageGenerationRequest, image: int) -> dict:
        return {**result.facts(image), "options": asked.options(result.request)}

    async def answer(self, request: Request, read) -> Response:
        """The request read (`read`), checked off the event loop, admitted into the engine's line, then answered
        whole or as a stream."""
        try:
            startup = self.engine.startup
            if not startup.ready:
                raise ApiError(503, f"the app is still warming up ({startup.shown}); /ready answers 200 once it is "
                                    "done", "server_error", "warming_up", retry_after=WARMING_RETRY_AFTER_S)
            asked = await read()
            checked = await run_in_threadpool(self.engine.check, asked.params())
            client = client_name(getattr(request.state, "caller", None), asked.user or asked.safety_identifier,
                                 peer=request.client.host if request.client else None)
            token = visitor_token(request.headers)
            job = WatchedJob(lambda report: self.engine.submit(checked, report, client=client, visitor_token=token))
            if asked.stream:
                return ProgressStream(self, job, asked, request).response()
            result = await self.finished(job, request)
        except Exception as error:
            return api_error(error).response()
        made = await run_in_threadpool(self.encoded, result, asked)
        return JSONResponse({"created": int(time.time()), "output_format": asked.format,
                             "background": "opaque", "quality": asked.quality or "auto",
                             "data": [self.image_data(request, asked, image) for image in made],
                             "size": str(result.request.shape),
                             "acceldemo": [self.facts(result, asked, i) for i in range(len(made))]},
                            headers=_fact_headers(result))

    @staticmethod
    async def finished(job: WatchedJob, client: Request) -> GenerateResult:
        """The job's result; a client that goes away stops it (at its next step, or out of the line)."""
        async for _ in job.events(DISCONNECT_POLL_S):
            if await client.is_disconnected():
                job.cancel()
        return await job.result()

    def image(self, image_id: str) -> Response:
        found = self.images.find(image_id)
        if found is None:
            return ApiError(404, f"no image {image_id!r}: images are served for {IMAGE_TTL_S // 60} minutes after "
                                 "they are made, and not after the app restarts", "invalid_request_error",
                            "image_not_found", "image_id").response()
        data, output_format = found
        return Response(data, media_type=FORMATS[output_format][1])

    def models(self) -> dict:
        return {"object": "list", "data": [_model_entry(m, self.listed_since) for m in self.engine.describe().models]}

    def model(self, name: str) -> Response:
        if name not in CATALOG:
            return api_error(UnknownName("model", name, CATALOG)).response()
        return JSONResponse(_model_entry(self.engine.describe().model(name), self.listed_since))


class ProgressStream:
    """Server-sent events as the images advance: ours per phase (in line, loading, compiling WxH, denoise step i/n,
    decoding), OpenAI's `image_generation.partial_image` for the previews asked for (`partial_images`), then OpenAI's
    `image_generation.completed` for each image. A request refused (invalid, line full) was answered with its error
    status before the stream starts; after it, a failure is an `error` event, which ends it."""

    def __init__(self, api: ImagesApi, job: WatchedJob, asked: ImageGenerationRequest, client: Request):
        self.api, self.job, self.asked, self.client = api, job, asked, client
        request = job.job.request
        self.wanted = partial_steps(request.steps, asked.partials)
        self.sent: dict[int, int] = {}  # partial images sent, per image of the request
        self.shown = {"background": "opaque", "output_format": asked.format, "quality": asked.quality or "auto",
                      "size": str(request.shape)}

    def response(self) -> StreamingResponse:
        return StreamingResponse(self.events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @staticmethod
    def event(name: str, data: dict) -> str:
        return f"event: {name}\ndata: {json.dumps(data)}\n\n"

    def progress(self, value: Progress) -> str:
        return self.event(PROGRESS_EVENT, {
            "type": PROGRESS_EVENT, "index": value.image, "phase": str(value.phase), "message": value.message,
            "step": value.step, "total": value.total, "elapsed": round(value.elapsed, 4),
            "expected": None if value.expected is None else round(value.expected, 1),
            "preview": value.preview is not None})

    def partial(self, value: Progress) -> str | None:
        """OpenAI's partial image for a preview at one of the `wanted` steps (or the first after it)."""
        count, kind = self.sent.get(value.image, 0), self.asked.stream_kind
        if value.preview is None or count >= len(self.wanted) or value.preview.step < self.wanted[count]:
            return None
        self.sent[value.image] = count + sum(1 for step in self.wanted[count:] if step <= value.preview.step)
        data = encode(value.preview.image(), self.asked.format, self.asked.output_compression)
        return self.event(f"{kind}.partial_image", {
            "type": f"{kind}.partial_image", "b64_json": base64.b64encode(data).decode(),
            "partial_image_index": count, "created_at": int(time.time()), **self.shown, "index": value.image})

    async def events(self) -> AsyncIterator[str]:
        job, kind = self.job, self.asked.stream_kind
        try:
            async for value in job.events(DISCONNECT_POLL_S):
                if value is None:
                    if await self.client.is_disconnected():
                        job.cancel()
                    continue
                yield self.progress(value)
                if value.preview is not None and self.wanted:
                    picture = await run_in_threadpool(self.partial, value)
                    if picture:
                        yield picture
            try:
                result = await job.result()
            except Exception as error:
                yield self.event("error", api_error(error).body())
                return
            made = await run_in_threadpool(self.api.encoded, result, self.asked)
            for i, image in enumerate(made):
                yield self.event(f"{kind}.completed", {
                    "type": f"{kind}.completed", **self.api.image_data(self.client, self.asked, image),
                    "created_at": int(time.time()), **self.shown, "usage": NO_USAGE, "index": i,
                    "acceldemo": self.api.facts(result, self.asked, i)})
        finally:  # also when the client went away and the server stopped sending
            job.cancel()


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
