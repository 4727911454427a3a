"""The serving process: Gradio page mounted on FastAPI beside /health, /ready, /status, /metrics, the
OpenAI-compatible Images API (/v1) and, when asked for, the MCP server (/gradio_api/mcp/). Its command line (app.py,
`python -m acceldemo serve`) is acceldemo/cli/serve.py."""
from __future__ import annotations

import contextlib
import hmac
import logging
import os

import gradio as gr
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import Engine, as_json, parse_resolution
from ..errors import InvalidRequest
from ..records import Shape
from .image_store import ImageStore
from .mcp_tools import MCP_PATH, TOOLS_MOUNT, tools_blocks
from .openai_api import openai_http_error, openai_router
from .page import CSS, build_page

log = logging.getLogger("acceldemo.server")


WARMUP_FORM = ("MODE:WxH[,WxH...][@B,B...][:quantization=Q,step_cache=C,lora=STYLE], e.g. compiled:64x64@1,2,4 "
               "or compiled:64x64:quantization=int8")
# The request values a warm-up spec may set beyond its mode, shapes and batch sizes.
WARMUP_OPTIONS = ("quantization", "step_cache", "lora")


def parse_warmup(spec: str | None) -> tuple[str, list[Shape], tuple[int, ...], dict[str, str]] | None:
    """`MODE:WxH,WxH[@B,B][:quantization=Q,step_cache=C,lora=STYLE]` (e.g. compiled:64x64,128x64@1,2,4) to a
    mode, shapes, the batch sizes compiled at each (calls drawing that many requests together; default 1) and the
    request's quantization, step cache and style (checked by the engine like any request's); None when unset."""
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


NEEDS_TOKEN = "this route needs Authorization: Bearer <ACCELDEMO_API_TOKEN>"


def bearer_ok(token: str | None, given: str) -> bool:
    """Whether an Authorization header's value lets a request in: any without a token configured, else `Bearer
    <token>` exactly (compared in constant time)."""
    return token is None or hmac.compare_digest(given.encode(), f"Bearer {token}".encode())


def bearer_guard(token: str | None):
    """A dependency that asks for `Authorization: Bearer <token>` when a token is configured."""
    def check(request: Request) -> None:
        if not bearer_ok(token, request.headers.get("authorization", "")):
            raise HTTPException(401, NEEDS_TOKEN, headers={"WWW-Authenticate": "Bearer"})
    return check


class McpDoor:
    """ASGI middleware in front of the MCP server: /gradio_api/mcp/ (and the paths below it) answered by the tools'
    own Gradio app mounted at TOOLS_MOUNT, and both behind the bearer token when ACCELDEMO_API_TOKEN is set, as /v1
    is."""

    def __init__(self, app, token: str | None):
        self.app, self.token = app, token

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        aliased = _under(path, MCP_PATH)
        if scope["type"] != "http" or not (aliased or _under(path, TOOLS_MOUNT)):
            return await self.app(scope, receive, send)
        if not bearer_ok(self.token, Headers(scope=scope).get("authorization", "")):
            answer = JSONResponse({"detail": NEEDS_TOKEN}, 401, headers={"WWW-Authenticate": "Bearer"})
            return await answer(scope, receive, send)
        if aliased:
            scope = {**scope, "path": TOOLS_MOUNT + path, "raw_path": (TOOLS_MOUNT + path).encode()}
        await self.app(scope, receive, send)


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + "/")


def create_app(engine: Engine, warmup: tuple | None = None, model: str | None = None,
               auth: tuple[str, str] | None = None, api_token: str | None = None, mcp: bool = False) -> FastAPI:
    """The whole HTTP surface; start-up warm-up runs in the background and /ready says 200 once it is done
    (or has run past `warmup_timeout_s`). With `mcp`, also an MCP server at /gradio_api/mcp/ (streamable HTTP)
    offering the tools of `mcp_tools`.

    `auth` protects the page and the Gradio API; `api_token` protects /status, /metrics, /v1 and the MCP server.
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
    if mcp:
        tools = tools_blocks(engine)
        gr.mount_gradio_app(app, tools, path=TOOLS_MOUNT, ssr_mode=False, mcp_server=True)
        if tools.mcp_error:  # Gradio serves on without its MCP server: asked for, its absence is an error
            raise RuntimeError(tools.mcp_error)
        app.add_middleware(McpDoor, token=api_token)
    page = build_page(engine)
    # Gradio's queue is only the page's transport: it hands every job to the page's handler at once, which admits it
    # into the engine's line before anything waits (or shows the engine's refusal), so the line is the only place a
    # request waits and its limit holds for every front end.
    page.queue(max_size=None, default_concurrency_limit=None)
    return gr.mount_gradio_app(app, page, path="/", ssr_mode=False, footer_links=["api"], auth=auth, css=CSS)

