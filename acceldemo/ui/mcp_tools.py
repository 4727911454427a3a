"""The MCP tools (Gradio's MCP server at /gradio_api/mcp/, on with --mcp / ACCELDEMO_MCP=1): draw an image, edit one,
list the models, plan a model on another host. Each is a plain function whose docstring and type hints Gradio turns
into the tool's description and input schema; each call goes through the engine's one line, as /v1's requests do.
They are the named endpoints of a Blocks of their own (`tools_blocks`), which server.py mounts beside the page."""
# No `from __future__ import annotations`: Gradio reads the return annotation itself (gr.api's outputs) and needs the
# type, not its name.
import asyncio
import base64
import binascii
import contextlib
import itertools
import json
import logging
import os
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from urllib.parse import unquote, urlsplit

import gradio as gr
from gradio.utils import get_upload_folder

from ..engine import Engine, ModelView
from ..errors import (
    AcceldemoError,
    CapacityExceeded,
    DeviceBusy,
    GpuQuotaExceeded,
    InvalidRequest,
    QueueFull,
    describe_error,
)
from ..records import GenerateParams, Phase, Progress
from .keys import Keys, client_name, visitor_token
from .openai_protocol import WARMING_RETRY_AFTER_S
from .page import image_file
from .watch import WatchedJob

log = logging.getLogger("acceldemo.mcp")
# The tools an MCP client is offered, and nothing of the page: its generate and compare stay the page's (and
# gradio_client's), and operator actions (warm_up, status) are no tool without an operator's key, which the MCP
# door does not take.
TOOLS = ("generate_image", "edit_image", "list_models", "plan")
# Where MCP clients are told to connect, and where the tools' Blocks is mounted (its Gradio app serves its MCP server
# at TOOLS_MOUNT + MCP_PATH; server.py's door answers MCP_PATH from there).
MCP_PATH = "/gradio_api/mcp"
TOOLS_MOUNT = "/mcp-tools"
# The engine's field names where a tool names its parameter otherwise: a refusal leads with the tool's name.
TOOL_NAMES = {"resolution": "size", "width": "size", "height": "size", "lora": "style", "lora_scale": "style"}
# The least time between two progress notifications of one call: a tiny model's call takes a few tenths of a second
# and its six events (each phase, each step) added 7% to it (bench section 15); a real model's steps are seconds
# apart, and each still gets its own.
PROGRESS_GAP_S = 0.25
PICTURE_FORMS = ("a data URL (data:image/png;base64,...), the file's bytes in base64, or the Image URL a tool of this "
                 "server answered")


class ToolError(gr.Error):
    """A refusal as an MCP client reads it (a tool error: isError, this text as it is) and the Gradio API shows it."""

    def __str__(self) -> str:  # gr.Error's is the message's repr, quoted
        return self.message


def refused(error: AcceldemoError) -> ToolError:
    """The engine's refusal as the tool's error: the tool's parameter at fault first (the engine's message names its
    own field, the value and what is accepted); a full line's message names its limit, ACCELDEMO_QUEUE_SIZE."""
    field = TOOL_NAMES.get(error.field, error.field)
    if field is None and isinstance(error, CapacityExceeded) and \
            not isinstance(error, QueueFull | DeviceBusy | GpuQuotaExceeded):
        field = "size"  # a new size past ACCELDEMO_MAX_SHAPES: the message lists those that work
    return ToolError(f"{field}: {error}" if field else str(error), print_exception=False)


@contextlib.contextmanager
def tool_errors() -> Iterator[None]:
    """Every failure inside as a tool error: the engine's typed refusals by their field, a bug of ours as one line."""
    try:
        yield
    except (ToolError, asyncio.CancelledError):
        raise
    except AcceldemoError as error:
        raise refused(error) from None
    except Exception as error:
        log.error("MCP tool call failed", exc_info=error)
        raise ToolError(f"internal error: {describe_error(error)}", print_exception=False) from None


def progress_sender() -> Callable[[Progress], Awaitable[None]] | None:
    """Where this call's progress goes: MCP progress notifications, when the client's call carried a progress token
    (None without one, and when the tool is called through the Gradio API instead); the first event at once, then at
    most one every PROGRESS_GAP_S."""
    from mcp.server.lowlevel.server import request_ctx

    try:
        context = request_ctx.get()
    except LookupError:
        return None
    token = context.meta.progressToken if context.meta is not None else None
    if token is None:
        return None
    count = itertools.count(1)  # MCP's progress must grow with each notification: phases have no common scale
    last: float | None = None

    async def send(event: Progress) -> None:
        nonlocal last
        if last is not None and time.monotonic() - last < PROGRESS_GAP_S:
            return
        last = time.monotonic()
        message = f"denoise {event.message}" if event.phase is Phase.DENOISE else event.message
        await context.session.send_progress_notification(token, next(count), message=message,
                                                          related_request_id=str(context.request_id))
    return send


def picture_bytes(text: str, field: str) -> bytes:
    """A picture as a tool is given it: a data URL, bare base64, or the Image URL of a picture this server served
    (read from Gradio's own folder of served files, and from nowhere else)."""
    text = text.strip()
    if "/gradio_api/file=" in text:
        served = Path(get_upload_folder()).resolve()
        path = Path(unquote(urlsplit(text).path.split("/gradio_api/file=", 1)[1])).resolve()
        if path.is_relative_to(served) and path.is_file():
            return path.read_bytes()
        raise InvalidRequest(field, text, f"{PICTURE_FORMS}; this URL names no picture this server still serves")
    if text.startswith("data:"):
        text = text.partition(",")[2]
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest(field, text, PICTURE_FORMS) from None


def model_facts(model: ModelView) -> dict:
    """A model in the tools' words: its sizes, the modes it runs in on each hardware here (or why not), its styles,
    how it edits and its step caches."""
    return {"name": model.name, "title": model.title, "description": model.description, "default": model.default,
            "available": model.available, "availability": model.availability, "size": str(model.default_size),
            "sizes": [str(s) for s in model.presets], "only_these_sizes": model.only_presets,
            "size_multiple_of": model.granularity, "steps": model.steps,
            "modes": {offer.hardware: {str(o.name): "ok" if o.ok else o.reason for o in offer.modes}
                      for offer in model.offers},
            "styles": [style["name"] for style in model.loras],
            "edits": {"method": str(model.edits), "mask": model.inpaints},
            "step_caches": ["none", "auto", *(c["name"] for c in model.step_caches if c["refused"] is None)]}


def check_arguments_once(blocks: gr.Blocks) -> None:
    """Check each tool call's arguments against its input schema with a validator built once per tool, in place of
    the MCP SDK's own check (`Server.call_tool(validate_input=True)`), which runs the one-shot `jsonschema.validate`:
    it checks the tool's schema against JSON Schema's meta-schema again on every call (9.5 ms of a call on an idle
    2-core host, 12-23 ms loaded; bench section 15), where a kept validator takes 0.05 ms. The SDK's client side was
    changed the same way (modelcontextprotocol/python-sdk#3134); mcp 1.x, which Gradio 6 takes, still does it on the
    server. The answer to bad arguments is the SDK's (a tool error "Input validation error: ...", by the same best
    match of the schema's errors), with the parameter at fault named first.

    Gradio registers its call handler through the SDK's decorator and keeps no name for it: the handler it made is
    registered again, through the same decorator with validate_input=False, behind this check."""
    from jsonschema.exceptions import best_match
    from jsonschema.validators import validator_for
    from mcp import types

    server = blocks.mcp_server_obj.mcp_server
    registered = server.request_handlers[types.CallToolRequest]
    call = registered.__closure__[registered.__code__.co_freevars.index("func")].cell_contents
    checkers: dict[str, object] = {}

    async def validator(name: str):
        """The tool's validator; the tools are listed again for a name not met yet (a listing within a call may be
        the subset its URL selects), and None for a name that is no tool (Gradio's call then says so)."""
        if name not in checkers:
            answer = await server.request_handlers[types.ListToolsRequest](None)
            for tool in answer.root.tools:
                if tool.name not in checkers:
                    kind = validator_for(tool.inputSchema)
                    kind.check_schema(tool.inputSchema)
                    checkers[tool.name] = kind(tool.inputSchema)
        return checkers.get(name)

    async def checked_call(name: str, arguments: dict):
        checker = await validator(name)
        error = best_match(checker.iter_errors(arguments)) if checker is not None else None
        if error is not None:  # the SDK's words, with the parameter at fault first
            field = ".".join(str(step) for step in error.absolute_path)
            text = f"Input validation error: {field + ': ' if field else ''}{error.message}"
            return types.CallToolResult(content=[types.TextContent(type="text", text=text)], isError=True)
        return await call(name, arguments)

    server.call_tool(validate_input=False)(checked_call)


def tools_blocks(engine: Engine, keys: Keys | None = None) -> gr.Blocks:
    """A Blocks whose named endpoints are the tools, and nothing else: Gradio's MCP server offers every named endpoint
    of its Blocks as a tool, so the page's own stay off the list, and a call does not pay for the page's many
    components (Gradio builds a session of the whole Blocks for every MCP call: 14 ms for the page, 0.3 ms for this
    one, measured here). Each tool is off Gradio's queue: a call goes straight to the engine's line, the only place a
    request waits."""
    tools = McpTools(engine, keys)
    # Served images are files in Gradio's cache: delete those older than an hour, every 10 minutes (as the page does).
    with gr.Blocks(title="acceldemo", delete_cache=(600, 3600)) as blocks:
        gr.Markdown(f"## acceldemo's MCP tools\nAn MCP client connects to `{MCP_PATH}/` (streamable HTTP); the page is "
                    "at `/`.")
        for name in TOOLS:
            gr.api(getattr(tools, name), api_name=name, queue=False)
    return blocks


class McpTools:
    """The tools over one engine. Drawing tools are coroutines (checking and encoding run in threads, the job in the
    engine's); the others are plain functions, which Gradio runs in a thread."""

    def __init__(self, engine: Engine, keys: Keys | None = None):
        self.engine, self.keys = engine, keys or Keys()
        self.outputs = Path(tempfile.mkdtemp(prefix="mcp-", dir=os.environ.get("GRADIO_TEMP_DIR")))

    def client(self, request: gr.Request | None) -> str:
        """Whose turn in line a call takes: its key's client (the MCP door let only valid keys in), else its peer."""
        caller = self.keys.known(request.headers.get("authorization") if request is not None else None)
        return client_name(caller, peer=getattr(getattr(request, "client", None), "host", None))

    async def draw(self, params: GenerateParams, request: gr.Request | None = None) -> tuple[gr.FileData, str]:
        """Check, admit into the engine's line (or refuse), follow, and answer the image as a PNG file with its facts
        (JSON); a call the client cancels stops its job."""
        with tool_errors():
            startup = self.engine.startup
            if not startup.ready:
                raise ToolError(f"the app is still warming up ({startup.shown}); try again in about "
                                f"{WARMING_RETRY_AFTER_S} s", print_exception=False)
            client = self.client(request)
            checked = await asyncio.to_thread(self.engine.check, params)
            token = visitor_token(getattr(request, "headers", None))
            job = WatchedJob(lambda report: self.engine.submit(checked, report, client=client, visitor_token=token))
            try:
                send = progress_sender()
                if send is not None:
                    async for event in job.events():
                        await send(event)
                result = await job.result()
            finally:
                job.cancel()  # a no-op once it ended
            path = await asyncio.to_thread(image_file, result.image, self.outputs)
        return gr.FileData(path=path, mime_type="image/png"), json.dumps(result.facts())

    async def generate_image(self, prompt: str, size: str | None = None, model: str | None = None,
                             steps: int | None = None, seed: int | None = None, mode: str | None = None,
                             step_cache: str | None = None, style: str | None = None,
                             request: gr.Request = None) -> tuple[gr.FileData, str]:
        """Draw a picture from a text prompt with one of this server's diffusion models. Use it when the user asks for
        an image; list_models tells the models, their sizes and modes. Answers the PNG image and its facts as JSON:
        seconds in all, compile seconds and graphs compiled, model, size, steps, seed and device. The same prompt,
        model, size, steps and seed draw the same picture again.

        Args:
            prompt: What to draw (at most 2000 characters), e.g. "a red circle on a blue background, top left".
            size: WIDTHxHEIGHT in pixels, e.g. 64x64: one of the model's sizes (list_models); default: its default size.
            model: A model name from list_models; default: the server's default model.
            steps: Denoising steps, 1 to the model's maximum; default: the model's.
            seed: A whole number from 0 that fixes the picture; default: a random one (the facts say which).
            mode: eager (default), compiled (torch.compile: a new size compiles first) or a mode list_models offers.
            step_cache: none (default), auto (the model's advice) or a step cache list_models offers for the model.
            style: none (default) or a LoRA style list_models offers for the model.
        """
        return await self.draw(GenerateParams(prompt=prompt, model=model, resolution=size, steps=steps, seed=seed,
                                              mode=mode, step_cache=step_cache, lora=style), request)

    async def edit_image(self, image: str, prompt: str, strength: float | None = None, mask: str | None = None,
                         size: str | None = None, model: str | None = None, steps: int | None = None,
                         seed: int | None = None, mode: str | None = None,
                         style: str | None = None, request: gr.Request = None) -> tuple[gr.FileData, str]:
        """Change a picture as a text prompt says, with one of this server's diffusion models: the picture is redrawn
        from itself (models whose edit method is strength), or guides the drawing as a reference picture (method
        reference); with a mask, only the mask's region changes (models that take a mask). list_models tells each
        model's method. Answers the PNG image and its facts as JSON, as generate_image does.

        Args:
            image: The picture (PNG, JPEG or WebP): a data URL, its base64, or an Image URL this server answered.
            prompt: What the picture should become (at most 2000 characters).
            strength: How much changes, above 0 up to 1 (strength and mask edits); default: the model's.
            mask: Optional PNG, transparent where the picture may change, given as the image is; default: all of it.
            size: WIDTHxHEIGHT of the result, one of the model's sizes; default: the picture's size.
            model: A model name from list_models; default: the server's default model.
            steps: Denoising steps, 1 to the model's maximum; default: the model's.
            seed: A whole number from 0 that fixes the result; default: a random one (the facts say which).
            mode: eager (default), compiled or another mode list_models offers.
            style: none (default) or a LoRA style list_models offers for the model.
        """
        with tool_errors():
            picture = picture_bytes(image, "image")
            region = None if mask is None else picture_bytes(mask, "mask")
        return await self.draw(GenerateParams(prompt=prompt, model=model, resolution=size, steps=steps, seed=seed,
                                              mode=mode, lora=style, image=picture, mask=region, strength=strength),
                               request)

    def list_models(self) -> str:
        """List the models this server draws with, as JSON: for each, its name, what it draws, whether it can run
        here, its default size and the sizes it draws at, its default steps, the modes it runs in on each hardware
        here (or why not), its LoRA styles, how it edits a picture and its step caches. Call it before generate_image
        or edit_image to choose a model, a size and a mode."""
        return json.dumps([model_facts(model) for model in self.engine.describe().models])

    def plan(self, model: str, host: str, quantization: str = "none") -> str:
        """Plan a model on a kind of host this server may not have, as `acceldemo plan` does, and answer as JSON: the
        placement (how the model is split over devices), the parallel degrees, memory per device, the best mode, the
        requests per call and the replicas. Use it to answer what running a model on some host would take; nothing
        is drawn.

        Args:
            model: A model name from list_models.
            host: A host kind such as h100x8, l4, trn2.48xlarge, inf2.xlarge or v6e-4; a wrong one lists them all.
            quantization: The weights' quantization: none (default), int8 or fp8.
        """
        with tool_errors():
            return json.dumps(self.engine.plan(model, host, quantization).facts())
