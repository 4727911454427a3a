"""The serving process: Gradio page mounted on FastAPI beside /health, /ready, /status, /metrics and the
OpenAI-compatible Images API (/v1)."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hmac
import logging
import os

import gradio as gr
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import config
from ..builder import build_engine
from ..config import Settings
from ..engine import Engine, as_json, parse_resolution
from ..errors import AcceldemoError, InvalidRequest
from ..records import Shape
from .openai_api import ImageStore, openai_http_error, openai_router
from .page import CSS, build_page

log = logging.getLogger("acceldemo.server")


WARMUP_FORM = ("MODE:WxH[,WxH...][@B,B...][:quantization=Q,step_cache=C], e.g. compiled:64x64@1,2,4 or "
               "compiled:64x64:quantization=int8")
# The request values a warm-up spec may set beyond its mode, shapes and batch sizes.
WARMUP_OPTIONS = ("quantization", "step_cache")


def parse_warmup(spec: str | None) -> tuple[str, list[Shape], tuple[int, ...], dict[str, str]] | None:
    """`MODE:WxH,WxH[@B,B][:quantization=Q,step_cache=C]` (e.g. compiled:64x64,128x64@1,2,4) to a mode, shapes, the
    batch sizes compiled at each (calls drawing that many requests together; default 1) and the request's quantization
    and step cache (checked by the engine like any request's); None when unset."""
    if not spec:
        return None
    mode, _, rest = spec.partition(":")
    rest, _, named = rest.partition(":")
    sizes, _, batches = rest.partition("@")
    try:
        counts = tuple(int(b) for b in batches.split(",") if b.strip()) or (1,)
        options = dict(part.split("=", 1) for part in named.split(",") if part.strip())
    except ValueError:
        raise InvalidRequest("warmup", spec, WARMUP_FORM) from None
    unknown = sorted(set(options) - set(WARMUP_OPTIONS))
    if unknown:
        raise InvalidRequest("warmup", spec, f"{WARMUP_FORM}; {unknown[0]} is not one of {', '.join(WARMUP_OPTIONS)}")
    return mode, [parse_resolution(s) for s in sizes.split(",") if s.strip()], counts, options


def parse_auth(text: str | None) -> tuple[str, str] | None:
    """USER:PASSWORD for the page and Gradio API; None when unset."""
    if not text:
        return None
    user, sep, password = text.partition(":")
    if not sep or not user or not password:
        raise ValueError("ACCELDEMO_AUTH / --auth must be USER:PASSWORD")
    return user, password


def bearer_guard(token: str | None):
    """A dependency that asks for `Authorization: Bearer <token>` when a token is configured."""
    def check(request: Request) -> None:
        if token is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            raise HTTPException(401, "this route needs Authorization: Bearer <ACCELDEMO_API_TOKEN>",
                                headers={"WWW-Authenticate": "Bearer"})
    return check


def create_app(engine: Engine, warmup: tuple | None = None, model: str | None = None,
               auth: tuple[str, str] | None = None, api_token: str | None = None) -> FastAPI:
    """The whole HTTP surface; start-up warm-up runs in the background and /ready says 200 once it is done
    (or has run past `warmup_timeout_s`).

    `auth` protects the page and the Gradio API; `api_token` protects /status, /metrics and /v1.
    /health and /ready stay open for load balancers.
    """
    guarded = [Depends(bearer_guard(api_token))]
    # Images answered as URLs, in the app's private temporary folder (app.py makes it 0700 and removes it at exit).
    images = ImageStore(parent=os.environ.get("GRADIO_TEMP_DIR"))

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        if warmup:
            mode, shapes, batches, *options = warmup
            engine.start_warm_up(mode, shapes, model=model, batches=batches, **(options[0] if options else {}))
        yield
        images.close()
        engine.close()

    app = FastAPI(lifespan=lifespan)

    @app.get("/health")
    def health() -> dict:
        return {"ok": True}

    @app.get("/ready")
    def ready():
        startup = engine.startup
        return JSONResponse({"ready": startup.ready, "warmup": startup.shown},
                            status_code=200 if startup.ready else 503)

    @app.get("/status", dependencies=guarded)
    def status() -> dict:
        return as_json(engine.snapshot())

    @app.get("/metrics", dependencies=guarded)
    def prometheus() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(engine.stats.registry), media_type=CONTENT_TYPE_LATEST)

    app.include_router(openai_router(engine, images, guarded))
    app.add_exception_handler(StarletteHTTPException, openai_http_error)
    page = build_page(engine)
    # Gradio's queue is only the page's transport: it hands every job to the page's handler at once, which admits it
    # into the engine's line before anything waits (or shows the engine's refusal), so the line is the only place a
    # request waits and its limit holds for every front end.
    page.queue(max_size=None, default_concurrency_limit=None)
    return gr.mount_gradio_app(app, page, path="/", ssr_mode=False, footer_links=["api"], auth=auth, css=CSS)


def main(argv: list[str] | None = None) -> None:
    """Build the settings once, prepare the process, build the engine, serve."""
    settings = Settings.from_env()
    parser = argparse.ArgumentParser(prog="app.py", description="Serve the acceldemo page and API.")
    parser.add_argument("--host", default=settings.host,
                        help="bind address (default 127.0.0.1; env GRADIO_SERVER_NAME, else ACCELDEMO_HOST)")
    parser.add_argument("--port", type=int, default=settings.port,
                        help="port (default 7860; env GRADIO_SERVER_PORT, else PORT)")
    parser.add_argument("--warmup", default=settings.warmup,
                        help="compile at start: MODE:WxH[,WxH...][@B,B...][:quantization=Q,step_cache=C], e.g. "
                             "compiled:64x64,128x64, or with the batch sizes of calls drawing requests together "
                             "compiled too, compiled:64x64@1,2,4, or int8 weights, compiled:64x64:quantization=int8 "
                             "(env ACCELDEMO_WARMUP)")
    parser.add_argument("--model", default=None, help="model warmed at start (default: the default model)")
    parser.add_argument("--download", action="store_true", default=settings.download,
                        help="fetch a real model missing here from the Hugging Face Hub (env ACCELDEMO_DOWNLOAD; on by "
                             "default in a Space unless HF_HUB_OFFLINE is set; HF_TOKEN for gated repositories)")
    parser.add_argument("--auth", default=settings.auth, help="USER:PASSWORD for the page and API (env ACCELDEMO_AUTH)")
    parser.add_argument("--replicas", help="copies of each pipeline, one per device set: N, or per hardware as "
                                           "cpu=2,cuda=4 (env ACCELDEMO_REPLICAS; default: the placement proposal)")
    parser.add_argument("--ray", default=settings.ray_address, metavar="ADDRESS",
                        help="run the pipeline replicas on a Ray cluster as a Ray Serve deployment: its address, or "
                             "auto for the one `ray start` began here (env ACCELDEMO_RAY_ADDRESS; needs "
                             "requirements-fleet.txt; autoscaling: ACCELDEMO_RAY_AUTOSCALING)")
    parser.add_argument("--artifacts", default=settings.artifacts, metavar="URL",
                        help="shared artifact store behind the local compile cache: a shared folder, "
                             "s3://bucket/prefix, gs://bucket/prefix or hf://datasets/ORG/NAME; read on a local miss, "
                             "written after every compile; writable by the operator only (env ACCELDEMO_ARTIFACTS; "
                             "fsspec options: ACCELDEMO_ARTIFACTS_OPTIONS)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import uvicorn

    from ..hardware import prepare_process

    try:
        warmup = parse_warmup(args.warmup)
        auth = parse_auth(args.auth)
        if args.replicas:
            settings = dataclasses.replace(settings, replicas=config.per_hardware("--replicas", args.replicas))
        settings = dataclasses.replace(settings, ray_address=args.ray or None, download=args.download,
                                       artifacts=config.store_url(args.artifacts, "--artifacts"))
    except (AcceldemoError, ValueError) as error:
        parser.error(str(error))
    open_doors = [door for door, guard in (("the page (no --auth)", auth),
                                           ("the /v1 API (no ACCELDEMO_API_TOKEN)", settings.api_token)) if not guard]
    if args.host not in ("127.0.0.1", "localhost", "::1") and open_doors:
        log.warning("serving on %s: anyone who reaches this address can use %s", args.host, " and ".join(open_doors))
    prepare_process(settings)
    if settings.ray_address:
        try:
            from ..fleet import fleet_engine
        except ImportError as error:
            parser.error(f"--ray needs Ray Serve: pip install -r requirements-fleet.txt ({error})")
        try:
            engine = fleet_engine(settings, args.model)
        except (AcceldemoError, ValueError, ConnectionError) as error:
            parser.error(f"--ray {settings.ray_address}: {error}")
    else:
        engine = build_engine(settings)
    app = create_app(engine, warmup, args.model, auth, settings.api_token)
    log.info("serving on http://%s:%d", args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5)
