"""`python -m acceldemo serve`, and app.py (the Space's entry point) with the same flags: the page on FastAPI beside
/health, /ready, /status, /metrics, the OpenAI-compatible Images API and (--mcp) the MCP server, at
http://127.0.0.1:7860 by default."""
from __future__ import annotations

import argparse
import atexit
import dataclasses
import importlib.util
import logging
import os
import shutil
import signal
import sys
import tempfile

from ..config import Settings, cache_dir_note, per_hardware, store_url
from ..errors import AcceldemoError, UnknownName
from ..hardware.zerogpu import POOL_REFUSAL, zero_gpu_on
from .common import HelpFormatter

log = logging.getLogger("acceldemo.server")
HELP = "serve the page and the API, as `python app.py` does (the same flags)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The serving options, for `app.py` and `python -m acceldemo serve` alike. Unset, each is the environment's
    (read by `Settings.from_env` when serving starts, so a bad variable never stands in the way of --help)."""
    parser.add_argument("--host",
                        help="bind address (default 127.0.0.1; env GRADIO_SERVER_NAME, else ACCELDEMO_HOST)")
    parser.add_argument("--port", type=int, help="port (default 7860; env GRADIO_SERVER_PORT, else PORT)")
    parser.add_argument("--warmup",
                        help="compile at start: MODE:WxH[,WxH...][@B,B...][:quantization=Q,step_cache=C,"
                             "lora=STYLE], e.g. compiled:64x64,128x64, or with the batch sizes of calls drawing "
                             "requests together compiled too, compiled:64x64@1,2,4, or int8 weights, "
                             "compiled:64x64:quantization=int8 "
                             "(env ACCELDEMO_WARMUP; default: none)")
    parser.add_argument("--model",
                        help="the default model: the one a request that names none gets, the page shows first and "
                             "the start-up warm-up compiles (default: env ACCELDEMO_DEFAULT_MODEL, else tiny-shapes)")
    parser.add_argument("--download", action="store_true", default=None,
                        help="fetch a real model missing here from the Hugging Face Hub (env ACCELDEMO_DOWNLOAD; on by "
                             "default in a Space unless HF_HUB_OFFLINE is set; HF_TOKEN for gated repositories)")
    parser.add_argument("--auth",
                        help="USER:PASSWORD for the page and API (env ACCELDEMO_AUTH; default: none, no login)")
    parser.add_argument("--mcp", action="store_true", default=None,
                        help="also serve an MCP server at /gradio_api/mcp/ (streamable HTTP) whose tools draw, edit, "
                             "list the models and plan; behind the client keys when they are set (env "
                             "ACCELDEMO_MCP; default: off)")
    parser.add_argument("--replicas", help="copies of each pipeline, one per device set: N, or per hardware as "
                                           "cpu=2,cuda=4 (env ACCELDEMO_REPLICAS; default: the placement proposal)")
    parser.add_argument("--ray", metavar="ADDRESS",
                        help="run the pipeline replicas on a Ray cluster as a Ray Serve deployment: its address, or "
                             "auto for the one `ray start` began here (env ACCELDEMO_RAY_ADDRESS; needs "
                             "requirements-fleet.txt, and the cluster's token: RAY_AUTH_MODE=token with RAY_AUTH_TOKEN "
                             "or RAY_AUTH_TOKEN_PATH, else ACCELDEMO_RAY_INSECURE=1; autoscaling: "
                             "ACCELDEMO_RAY_AUTOSCALING; default: none, this host's devices)")
    parser.add_argument("--artifacts", metavar="URL",
                        help="shared artifact store behind the local compile cache: a shared folder, "
                             "s3://bucket/prefix, gs://bucket/prefix or hf://datasets/ORG/NAME; read on a local miss, "
                             "written after every compile; writable by the operator only (env ACCELDEMO_ARTIFACTS; "
                             "fsspec options: ACCELDEMO_ARTIFACTS_OPTIONS; default: none)")


def add_parser(commands) -> None:
    add_arguments(commands.add_parser("serve", help=HELP, description=__doc__))


def check_model(name: str) -> str:
    """A catalog model's name; any other is refused with the names of those there are."""
    from ..models.catalog import CATALOG

    if name not in CATALOG:
        raise UnknownName("model", name, CATALOG)
    return name


def serve_settings(args: argparse.Namespace, settings: Settings) -> Settings:
    """The environment's settings with the flags given on top (each checked as its variable would be)."""
    changes: dict[str, object] = {"download": bool(args.download) or settings.download,
                                  "mcp": bool(args.mcp) or settings.mcp}
    if args.replicas:
        changes["replicas"] = per_hardware("--replicas", args.replicas)
    if args.ray is not None:
        changes["ray_address"] = args.ray or None
    if args.artifacts is not None:
        changes["artifacts"] = store_url(args.artifacts, "--artifacts")
    for name in ("host", "port", "warmup", "auth"):
        if getattr(args, name) is not None:
            changes[name] = getattr(args, name)
    if args.model is not None:
        changes["default_model"] = check_model(args.model)
    return dataclasses.replace(settings, **changes)


def prepare_environment() -> None:
    """Before Gradio is imported: no analytics, and generated images in a private (0700) folder of this process,
    removed when it exits. The examples' cached pictures live there too: drawn by this process's weights, never a
    folder in the working directory that a later version would read back as current."""
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    if "GRADIO_TEMP_DIR" not in os.environ:
        os.environ["GRADIO_TEMP_DIR"] = tempfile.mkdtemp(prefix="acceldemo-images-")
        atexit.register(shutil.rmtree, os.environ["GRADIO_TEMP_DIR"], True)
    os.environ.setdefault("GRADIO_EXAMPLES_CACHE", os.path.join(os.environ["GRADIO_TEMP_DIR"], "examples"))


def _refuse(message: object) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def serve(args: argparse.Namespace) -> int:
    """Build the settings once, prepare the process, build the engine, serve; a refused setting (flag or variable)
    is one `error:` line and exit status 2."""
    prepare_environment()
    try:
        settings = serve_settings(args, Settings.from_env())
        from ..ui.keys import Keys
        from ..ui.server import create_app, parse_auth, parse_warmup

        warmup = parse_warmup(settings.warmup)
        auth = parse_auth(settings.auth)
        keys = Keys.from_settings(settings.api_keys, settings.admin_key, settings.admin_key_file, settings.api_token)
    except (AcceldemoError, ValueError) as error:
        return _refuse(error)
    if settings.mcp and importlib.util.find_spec("mcp") is None:
        return _refuse("--mcp / ACCELDEMO_MCP needs the mcp package: pip install -r requirements.txt")
    # uvicorn shuts down gracefully on SIGTERM, then raises the signal again for the handler it found: make that an
    # exit that runs the atexit clean-ups (the image folder, any worker pool) instead of a kill that skips them.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    log.info(cache_dir_note(settings))
    if zero_gpu_on():
        if settings.ray_address:
            return _refuse(f"--ray on ZeroGPU (SPACES_ZERO_GPU is set): {POOL_REFUSAL}")
        if any(count > 1 for count in settings.replicas.values()):
            return _refuse(f"--replicas on ZeroGPU (SPACES_ZERO_GPU is set): {POOL_REFUSAL}")
        log.info("ZeroGPU: each draw asks the platform for a %s GPU slice (spaces.GPU); compiled shapes are the "
                 "ones warmed up", settings.zero_gpu_size)
    import uvicorn

    from ..builder import build_engine
    from ..hardware import prepare_process

    doors = [("the page (no --auth)", auth), ("the /v1 API (no ACCELDEMO_API_KEYS)", keys.required),
             *([("the MCP server (no keys)", keys.required)] if settings.mcp else []),
             ("the operator's actions (no ACCELDEMO_ADMIN_KEY)", keys.operator_required)]
    open_doors = [door for door, guard in doors if not guard]
    if settings.host not in ("127.0.0.1", "localhost", "::1") and open_doors:
        log.warning("serving on %s: anyone who reaches this address can use %s", settings.host,
                    " and ".join(open_doors))
    try:
        prepare_process(settings)
        if settings.ray_address:
            try:
                from ..fleet import fleet_engine
            except ImportError as error:
                return _refuse(f"--ray needs Ray Serve: pip install -r requirements-fleet.txt ({error})")
            try:
                engine = fleet_engine(settings, args.model)
            except (AcceldemoError, ValueError, ConnectionError) as error:
                return _refuse(f"--ray {settings.ray_address}: {error}")
        else:
            engine = build_engine(settings)
    except (AcceldemoError, ValueError) as error:
        return _refuse(error)
    app = create_app(engine, warmup, args.model, auth, keys, settings.mcp)
    if zero_gpu_on():
        from ..executors.zerogpu import start_zero_gpu

        start_zero_gpu(settings)
    log.info("serving on http://%s:%d", settings.host, settings.port)
    if settings.mcp:
        log.info("MCP server (streamable HTTP) on http://%s:%d/gradio_api/mcp/", settings.host, settings.port)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level="warning", timeout_graceful_shutdown=5)
    return 0


def main(argv: list[str] | None = None) -> int:
    """app.py's command line: the serve subcommand's flags, under the name the Space runs."""
    parser = argparse.ArgumentParser(prog="app.py", description="Serve the acceldemo page and API.",
                                     formatter_class=HelpFormatter)
    add_arguments(parser)
    return serve(parser.parse_args(argv))
