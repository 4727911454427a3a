"""The serving process: Gradio page mounted on FastAPI beside /health, /ready, /status, /metrics and the
OpenAI-compatible Images API (/v1)."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hmac
import logging
import os
import threading

import gradio as gr
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import config
from ..engine import SessionManager, parse_resolution
from ..errors import AcceldemoError
from ..executors.routing import RoutingExecutor
from ..records import GenerateRequest
from .openai_api import ImageStore, openai_http_error, openai_router
from .page import build_page, status_json

log = logging.getLogger("acceldemo.server")


def parse_warmup(spec: str | None) -> tuple[str, list] | None:
    """`MODE:WxH,WxH` (e.g. compiled:64x64,128x64) to a mode and shapes; None when unset."""
    if not spec:
        return None
    mode, _, sizes = spec.partition(":")
    return mode, [parse_resolution(s) for s in sizes.split(",") if s.strip()]


def _warm_up_at_start(manager: SessionManager, warmup: tuple[str, list], startup: dict, model: str | None,
                      lock: threading.Lock) -> None:
    mode, shapes = warmup
    try:
        records = manager.warm_up(GenerateRequest(prompt="warm-up", model=model, mode=mode), shapes)
        outcome = "done: " + ", ".join(f"{r.shape} {r.state}" for r in records)
    except AcceldemoError as error:
        outcome = f"failed: {error}"
    with lock:  # the real outcome replaces a "still going" note written when /ready stopped waiting
        startup["state"], startup["done"] = outcome, True


def _stop_waiting_for_warm_up(startup: dict, limit: float, lock: threading.Lock) -> None:
    with lock:
        if startup.get("done"):
            return
        # A compile in this process cannot be interrupted (a thread cannot be killed), so the app stops waiting
        # instead: it serves, and requests for the warming device queue behind it (ACCELDEMO_DEVICE_WAIT_S).
        startup["state"] += (f"; still going after {limit:.0f} s (ACCELDEMO_WARMUP_TIMEOUT_S): serving meanwhile, "
                             "requests for that device wait for it")
        startup["done"] = True


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


def create_app(manager: SessionManager, warmup: tuple[str, list] | None = None, model: str | None = None,
               auth: tuple[str, str] | None = None, api_token: str | None = None) -> FastAPI:
    """The whole HTTP surface; start-up warm-up runs in the background and /ready says 200 once it is done
    (or has run past `warmup_timeout_s`).

    `auth` protects the page and the Gradio API; `api_token` protects /status, /metrics and /v1.
    /health and /ready stay open for load balancers.
    """
    guarded = [Depends(bearer_guard(api_token))]
    startup: dict = {} if warmup else {"done": True}
    # Images answered as URLs, in the app's private temporary folder (app.py makes it 0700 and removes it at exit).
    images = ImageStore(parent=os.environ.get("GRADIO_TEMP_DIR"))

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        watchdog = None
        if warmup:
            mode, shapes = warmup
            startup["state"] = f"warming {', '.join(map(str, shapes))} ({mode})"
            lock, limit = threading.Lock(), manager.settings.warmup_timeout_s
            threading.Thread(target=_warm_up_at_start, args=(manager, warmup, startup, model, lock), daemon=True,
                             name="startup-warmup").start()
            watchdog = threading.Timer(limit, _stop_waiting_for_warm_up, args=(startup, limit, lock))
            watchdog.daemon = True
            watchdog.start()
        yield
        if watchdog is not None:
            watchdog.cancel()
        images.close()
        manager.close()

    app = FastAPI(lifespan=lifespan)

    @app.get("/health")
    def health() -> dict:
        return {"ok": True}

    @app.get("/ready")
    def ready():
        done = bool(startup.get("done"))
        return JSONResponse({"ready": done, "warmup": startup.get("state", "none configured")},
                            status_code=200 if done else 503)

    @app.get("/status", dependencies=guarded)
    def status() -> dict:
        return status_json(manager, startup)

    @app.get("/metrics", dependencies=guarded)
    def prometheus() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(manager.stats.registry), media_type=CONTENT_TYPE_LATEST)

    app.include_router(openai_router(manager, startup, images, guarded))
    app.add_exception_handler(StarletteHTTPException, openai_http_error)
    page = build_page(manager, startup)
    # Gradio's queue is only the page's transport: it passes every job on to the engine, whose line decides who
    # waits, who runs and who is refused (one limit for every front end). So its concurrency, and its worker
    # threads, cover what the engine can hold: a job per device plus the line.
    page.max_threads = manager.capacity()
    page.queue(max_size=None, default_concurrency_limit=manager.capacity())
    return gr.mount_gradio_app(app, page, path="/", ssr_mode=False, footer_links=["api"], auth=auth)


def main(argv: list[str] | None = None) -> None:
    settings = config.settings()
    parser = argparse.ArgumentParser(prog="app.py", description="Serve the acceldemo page and API.")
    parser.add_argument("--host", default=settings.host,
                        help="bind address (default 127.0.0.1; env GRADIO_SERVER_NAME, else ACCELDEMO_HOST)")
    parser.add_argument("--port", type=int, default=settings.port,
                        help="port (default 7860; env GRADIO_SERVER_PORT, else PORT)")
    parser.add_argument("--warmup", default=settings.warmup,
                        help="compile at start: MODE:WxH[,WxH...], e.g. compiled:64x64,128x64 (env ACCELDEMO_WARMUP)")
    parser.add_argument("--model", default=None, help="model warmed at start (default: the default model)")
    parser.add_argument("--auth", default=settings.auth, help="USER:PASSWORD for the page and API (env ACCELDEMO_AUTH)")
    parser.add_argument("--replicas", help="copies of each pipeline, one per device set: N, or per hardware as "
                                           "cpu=2,cuda=4 (env ACCELDEMO_REPLICAS; default: the placement proposal)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import uvicorn

    try:
        warmup = parse_warmup(args.warmup)
        auth = parse_auth(args.auth)
        if args.replicas:  # the hardware adapters read the process's settings: they must see it too
            settings = dataclasses.replace(settings, replicas=config.per_hardware("--replicas", args.replicas))
            config.use(settings)
    except (AcceldemoError, ValueError) as error:
        parser.error(str(error))
    open_doors = [door for door, guard in (("the page (no --auth)", auth),
                                           ("the /v1 API (no ACCELDEMO_API_TOKEN)", settings.api_token)) if not guard]
    if args.host not in ("127.0.0.1", "localhost", "::1") and open_doors:
        log.warning("serving on %s: anyone who reaches this address can use %s", args.host, " and ".join(open_doors))
    app = create_app(SessionManager(settings, RoutingExecutor(settings)), warmup, args.model, auth,
                     settings.api_token)
    log.info("serving on http://%s:%d", args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5)
