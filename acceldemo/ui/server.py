"""The serving process: Gradio page mounted on FastAPI beside /health, /ready, /status, /metrics, the
OpenAI-compatible Images API (/v1) and, when asked for, the MCP server (/gradio_api/mcp/). Its command line (app.py,
`python -m acceldemo serve`) is acceldemo/cli/serve.py."""
from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable

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
from .keys import VISITOR, Caller, Keys, Refused
from .mcp_tools import MCP_PATH, TOOLS_MOUNT, check_arguments_once, tools_blocks
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


def guard(keys: Keys, count: Callable, door: str, operator: bool = False):
    """A dependency that lets in whom the keys let through this door (a client key; the operator key for operator
    actions), counted by client; 401 or 403 otherwise."""
    def check(request: Request) -> None:
        try:
            caller = (keys.operator_door if operator else keys.client_door)(request.headers.get("authorization"))
        except Refused as refused:
            count(door, refused.caller, refused=True)
            raise HTTPException(refused.status, refused.message,
                                headers={"WWW-Authenticate": "Bearer"} if refused.status == 401 else None) from None
        count(door, caller)
        request.state.caller = caller
    return check


# The routes FastAPI answers itself, each guarded by its own dependency (or open: /health, /ready).
OWN_ROUTES = ("/v1", "/status", "/metrics", "/health", "/ready")
# The Gradio API's routes that run an event (the others serve the page, its files and its config).
GRADIO_CALLS = ("/gradio_api/queue/join", "/gradio_api/call/", "/gradio_api/run/")


class KeyDoor:
    """ASGI middleware for the doors FastAPI's dependencies do not reach: the MCP server (/gradio_api/mcp/, answered
    by the tools' own Gradio app mounted at TOOLS_MOUNT), which needs a client key when keys are set, as /v1 does; and
    the Gradio API, where a request that carries a key must carry a valid one (a browser on the page carries none: it
    is a visitor, as on the page). Both counted by client in /metrics."""

    def __init__(self, app, keys: Keys, count: Callable):
        self.app, self.keys, self.count = app, keys, count

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or any(_under(path, route) for route in OWN_ROUTES):
            return await self.app(scope, receive, send)
        aliased = _under(path, MCP_PATH)
        door = "mcp" if aliased or _under(path, TOOLS_MOUNT) else "gradio"
        authorization = Headers(scope=scope).get("authorization")
        if door == "gradio" and authorization and not authorization.lower().startswith("bearer"):
            authorization = None  # another scheme (a proxy's Basic login in front of the page) names no key here
        try:
            caller = (self.keys.client_door(authorization) if door == "mcp" else
                      self.keys.caller(authorization) or Caller(VISITOR, not self.keys.operator_required))
        except Refused as refused:
            self.count(door, refused.caller, refused=True)
            answer = JSONResponse({"detail": refused.message}, refused.status,
                                  headers={"WWW-Authenticate": "Bearer"} if refused.status == 401 else None)
            return await answer(scope, receive, send)
        if door == "mcp" or (scope.get("method") == "POST" and path.startswith(GRADIO_CALLS)):
            self.count(door, caller)
        scope = {**scope, "state": {**scope.get("state", {}), "caller": caller}}
        if aliased:
            scope = {**scope, "path": TOOLS_MOUNT + path, "raw_path": (TOOLS_MOUNT + path).encode()}
        await self.app(scope, receive, send)


def counter(engine: Engine) -> Callable:
    """count(door, caller, refused=False): /metrics' requests at each door by client name (a key's name, `visitor`,
    or `unauthenticated` for a missing or wrong key: never the key, nor anything a caller types)."""
    def count(door: str, caller: Caller | None, refused: bool = False) -> None:
        client = "unauthenticated" if caller is None else caller.client
        engine.stats.clients.labels(door, client, "refused" if caller is None or refused else "admitted").inc()
    return count


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + "/")


def create_app(engine: Engine, warmup: tuple | None = None, model: str | None = None,
               auth: tuple[str, str] | None = None, keys: Keys | None = None, mcp: bool = False) -> FastAPI:
    """The whole HTTP surface; start-up warm-up runs in the background and /ready says 200 once it is done
    (or has run past `warmup_timeout_s`). With `mcp`, also an MCP server at /gradio_api/mcp/ (streamable HTTP)
    offering the tools of `mcp_tools`.

    `auth` protects the page and the Gradio API with a login. `keys` (see keys.py): /v1 and the MCP server need a
    client key, /status, /metrics and the page's operator actions the operator key; a Gradio API request that carries
    a key must carry a valid one. /health and /ready stay open for load balancers.
    """
    keys = keys or Keys()
    count = counter(engine)
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

    @app.get("/status", dependencies=[Depends(guard(keys, count, "status", operator=True))])
    def status() -> dict:
        return as_json(engine.snapshot())

    @app.get("/metrics", dependencies=[Depends(guard(keys, count, "metrics", operator=True))])
    def prometheus() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(engine.stats.registry), media_type=CONTENT_TYPE_LATEST)

    app.include_router(openai_router(engine, images, [Depends(guard(keys, count, "v1"))]))
    app.add_exception_handler(StarletteHTTPException, openai_http_error)
    if mcp:
        tools = tools_blocks(engine, keys)
        gr.mount_gradio_app(app, tools, path=TOOLS_MOUNT, ssr_mode=False, mcp_server=True)
        if tools.mcp_error:  # Gradio serves on without its MCP server: asked for, its absence is an error
            raise RuntimeError(tools.mcp_error)
        check_arguments_once(tools)
    app.add_middleware(KeyDoor, keys=keys, count=count)
    page = build_page(engine, keys)
    # Gradio's queue is only the page's transport: it hands every job to the page's handler at once, which admits it
    # into the engine's line before anything waits (or shows the engine's refusal), so the line is the only place a
    # request waits and its limit holds for every front end.
    page.queue(max_size=None, default_concurrency_limit=None)
    return gr.mount_gradio_app(app, page, path="/", ssr_mode=False, footer_links=["api"], auth=auth, css=CSS)

