"""The serving process: Gradio page mounted on FastAPI beside /health, /ready, /status and /metrics."""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import threading

import gradio as gr
from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..engine import SessionManager, check_request, parse_resolution
from ..errors import AcceldemoError
from ..records import GenerateRequest
from .metrics import Metrics
from .page import build_page, status_json

log = logging.getLogger("acceldemo.server")
QUEUE_SIZE = int(os.environ.get("ACCELDEMO_QUEUE_SIZE", "64"))


def parse_warmup(spec: str | None) -> tuple[str, list] | None:
    """`MODE:WxH,WxH` (e.g. compiled:64x64,128x64) to a mode and shapes; None when unset."""
    if not spec:
        return None
    mode, _, sizes = spec.partition(":")
    return mode, [parse_resolution(s) for s in sizes.split(",") if s.strip()]


def _warm_up_at_start(manager: SessionManager, warmup: tuple[str, list], startup: dict, model: str | None) -> None:
    mode, shapes = warmup
    startup["state"] = f"warming {', '.join(map(str, shapes))} ({mode})"
    try:
        base = check_request(GenerateRequest(prompt="warm-up", model=model, mode=mode))
        records = manager.warm_up(base, shapes)
        startup["state"] = "done: " + ", ".join(f"{r.shape} {r.state}" for r in records)
    except AcceldemoError as error:
        startup["state"] = f"failed: {error}"
    startup["done"] = True


def create_app(manager: SessionManager, warmup: tuple[str, list] | None = None, model: str | None = None) -> FastAPI:
    """The whole HTTP surface; start-up warm-up runs in the background and /ready tells when it is done."""
    metrics = Metrics(manager)
    startup: dict = {} if warmup else {"done": True}

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        if warmup:
            threading.Thread(target=_warm_up_at_start, args=(manager, warmup, startup, model), daemon=True,
                             name="startup-warmup").start()
        yield
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

    @app.get("/status")
    def status() -> dict:
        return status_json(manager, startup)

    @app.get("/metrics")
    def prometheus() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    page = build_page(manager, metrics, startup)
    page.queue(max_size=QUEUE_SIZE, default_concurrency_limit=1)
    return gr.mount_gradio_app(app, page, path="/", ssr_mode=False, footer_links=["api"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="app.py", description="Serve the acceldemo page and API.")
    parser.add_argument("--host", default=os.environ.get("ACCELDEMO_HOST", "127.0.0.1"),
                        help="bind address (default 127.0.0.1; env ACCELDEMO_HOST)")
    parser.add_argument("--port", type=int, default=int(os.environ.get("PORT", "7860")),
                        help="port (default 7860; env PORT)")
    parser.add_argument("--warmup", default=os.environ.get("ACCELDEMO_WARMUP"),
                        help="compile at start: MODE:WxH[,WxH...], e.g. compiled:64x64,128x64 (env ACCELDEMO_WARMUP)")
    parser.add_argument("--model", default=None, help="model warmed at start (default: the default model)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import uvicorn

    try:
        warmup = parse_warmup(args.warmup)
    except AcceldemoError as error:
        parser.error(str(error))
    app = create_app(SessionManager(), warmup, args.model)
    log.info("serving on http://%s:%d", args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
