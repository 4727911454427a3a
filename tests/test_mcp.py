"""The MCP server (app.py --mcp), through the official mcp client over streamable HTTP against the real app process on
loopback: exactly the deliberate tools with their typed parameters, pictures the model's judge reads back, refusals
as tool errors naming the field or the limit, and the bearer token."""
import argparse
import asyncio
import base64
import dataclasses
import io
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import httpx
import pytest
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.types import CallToolResult, ImageContent, TextContent
from PIL import Image

from acceldemo.cli.serve import add_arguments, serve_settings
from acceldemo.config import Settings
from acceldemo.ui.mcp_tools import TOOLS, TOOLS_MOUNT
from tests.engines import free_port, wait_until_answers
from training.shapes.dataset import Scene, render
from training.shapes.judge import judge

ROOT = Path(__file__).resolve().parents[1]
RED = "a red circle on a blue background, top left"
GREEN = "a green circle on a blue background, top left"
TOKEN = "mcp-test-token"


def in_session(url: str, work, headers: dict | None = None, query: str = ""):
    """`work(session)` in an initialized MCP session with the app at `url` (streamable HTTP); its answer."""
    async def run():
        async with httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(60, read=300)) as http, \
                streamable_http_client(f"{url}/gradio_api/mcp/{query}", http_client=http) as (read, write, _), \
                ClientSession(read, write) as session:
            await session.initialize()
            return await work(session)
    return asyncio.run(run())


def call(url: str, tool: str, arguments: dict, headers: dict | None = None) -> CallToolResult:
    return in_session(url, lambda session: session.call_tool(tool, arguments), headers)


def picture_and_facts(answer: CallToolResult) -> tuple[Image.Image, dict, str]:
    """A drawing tool's answer: the PNG, its facts and the Image URL the server gave."""
    assert not answer.isError, answer.content
    image, link, facts = answer.content
    assert isinstance(image, ImageContent) and image.mimeType == "image/png"
    assert isinstance(link, TextContent) and link.text.startswith("Image URL: http://127.0.0.1:")
    return Image.open(io.BytesIO(base64.b64decode(image.data))), json.loads(facts.text), link.text.split(": ", 1)[1]


def refusal(answer: CallToolResult) -> str:
    assert answer.isError, answer.content
    return answer.content[0].text


def test_the_mcp_server_is_off_unless_the_flag_or_the_variable_asks_for_it():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert not Settings.from_env({}).mcp and Settings.from_env({"ACCELDEMO_MCP": "1"}).mcp
    settings = Settings.from_env({})
    assert not serve_settings(parser.parse_args([]), settings).mcp
    assert serve_settings(parser.parse_args(["--mcp"]), settings).mcp
    assert serve_settings(parser.parse_args([]), dataclasses.replace(settings, mcp=True)).mcp
    with pytest.raises(ValueError, match="ACCELDEMO_MCP='maybe' is not accepted"):
        Settings.from_env({"ACCELDEMO_MCP": "maybe"})


@pytest.fixture(scope="module")
def app(server) -> str:
    """The session's app.py (--mcp), once its start-up warm-up is done."""
    deadline = time.time() + 180
    while True:
        try:
            with urllib.request.urlopen(server + "/ready", timeout=10):
                return server
        except OSError:
            assert time.time() < deadline, "start-up warm-up never finished"
            time.sleep(0.5)


@pytest.mark.heavy  # the session's app.py: outside --fast, in the full run
def test_the_tools_are_exactly_the_deliberate_ones_with_typed_parameters(app):
    listed = {tool.name: tool for tool in in_session(app, ClientSession.list_tools).tools}
    assert list(listed) == list(TOOLS) == ["generate_image", "edit_image", "list_models", "plan"]

    def parameters(name: str) -> dict[str, str]:
        types = {}
        for parameter, schema in listed[name].inputSchema["properties"].items():
            assert schema["description"], (name, parameter)  # each documented for the model that calls it
            kinds = [option["type"] for option in schema.get("oneOf", [schema])]
            types[parameter] = "|".join(kind for kind in kinds if kind != "null")
        return types

    optional_drawing = {"size": "string", "model": "string", "steps": "integer", "seed": "integer", "mode": "string"}
    assert parameters("generate_image") == {"prompt": "string", **optional_drawing, "step_cache": "string",
                                            "style": "string"}
    assert listed["generate_image"].inputSchema["required"] == ["prompt"]
    assert parameters("edit_image") == {"image": "string", "prompt": "string", "strength": "number", "mask": "string",
                                        **optional_drawing, "style": "string"}
    assert listed["edit_image"].inputSchema["required"] == ["image", "prompt"]
    assert parameters("list_models") == {}
    assert parameters("plan") == {"model": "string", "host": "string", "quantization": "string"}
    assert listed["plan"].inputSchema["required"] == ["model", "host"]
    for tool in listed.values():
        assert "Args:" not in tool.description and len(tool.description) > 100, tool.name


@pytest.mark.heavy  # the session's app.py: outside --fast, in the full run
def test_operator_actions_and_the_pages_own_endpoints_are_no_tools(app):
    async def work(session):
        return ([tool.name for tool in (await session.list_tools()).tools],
                [await session.call_tool(name, {}) for name in ("warm_up", "generate", "compare")])

    names, calls = in_session(app, work)
    assert not {"warm_up", "status", "refresh_status", "generate", "compare", "stop"} & set(names)
    for name, answer in zip(("warm_up", "generate", "compare"), calls):
        assert refusal(answer) == f"Unknown tool for this Gradio app: {name}"
    # Gradio's own selection of tools by the client narrows the list; it cannot widen it.
    narrowed = in_session(app, ClientSession.list_tools, query="?tools=warm_up,plan")
    assert [tool.name for tool in narrowed.tools] == ["plan"]
    # The page's API for gradio_client is as it was: the tools are no endpoints of the page.
    with urllib.request.urlopen(app + "/gradio_api/info") as answer:
        endpoints = set(json.load(answer)["named_endpoints"])
    assert {"/generate", "/compare", "/warm_up"} <= endpoints and not {f"/{name}" for name in TOOLS} & endpoints


@pytest.mark.heavy  # the session's app.py: outside --fast, in the full run
def test_generate_image_draws_the_asked_scene_at_the_asked_size_with_progress(app):
    steps = []

    async def work(session):
        async def progress(value, total, message):
            steps.append((value, message))
        return await session.call_tool("generate_image", {"prompt": RED, "model": "tiny-shapes", "size": "128x64",
                                                          "seed": 1}, progress_callback=progress)

    image, facts, _ = picture_and_facts(in_session(app, work))
    seen = judge(image.convert("RGB"))
    assert image.size == (128, 64) and (seen.colour, seen.shape, seen.background, seen.position) == \
        ("red", "circle", "blue", "top left"), seen
    assert (facts["model"], facts["width"], facts["height"], facts["seed"], facts["steps"]) == \
        ("tiny-shapes", 128, 64, 1, 4)
    assert facts["seconds"] > 0 and "new_graphs" in facts
    # The first event at once (the request in line, or given its device), then at most one every PROGRESS_GAP_S;
    # MCP's progress only grows.
    assert steps and steps[0][1].startswith(("running on cpu:0", "1st in line")), steps
    assert [value for value, _ in steps] == list(range(1, len(steps) + 1))
    assert all(message.startswith(("running on", "1st in line", "loading", "placing", "denoise step", "decoding"))
               for _, message in steps), steps


@pytest.mark.heavy  # the session's app.py: outside --fast, in the full run
def test_a_refused_request_is_a_tool_error_naming_the_field(app):
    size = refusal(call(app, "generate_image", {"prompt": RED, "model": "tiny-shapes", "size": "100x64"}))
    assert size.startswith("size: resolution='100x64' is not accepted: one of the sizes tiny-shapes draws "
                           "correctly: 64x64"), size
    assert refusal(call(app, "generate_image", {"prompt": RED, "size": "big"})).startswith(
        "size: resolution='big' is not accepted: WIDTHxHEIGHT")
    assert refusal(call(app, "generate_image", {"prompt": RED, "model": "nope"})).startswith(
        "model: model='nope' is not accepted: known values are ")
    assert refusal(call(app, "generate_image", {"prompt": RED, "model": "tiny-shapes", "style": "sepia"})).startswith(
        "style: lora='sepia' is not accepted")
    assert refusal(call(app, "edit_image", {"image": "not a picture!", "prompt": GREEN})).startswith(
        "image: image='not a picture!' is not accepted: a data URL")
    # Arguments the tool's schema refuses, before the engine sees them: a wrong type, a missing parameter.
    assert refusal(call(app, "generate_image", {"prompt": RED, "steps": "many"})) == \
        "Input validation error: steps: 'many' is not valid under any of the given schemas"
    assert refusal(call(app, "generate_image", {"size": "64x64"})) == \
        "Input validation error: 'prompt' is a required property"


@pytest.mark.heavy  # the session's app.py: outside --fast, in the full run
def test_edit_image_redraws_a_picture_given_as_data_url_or_as_the_servers_own_image_url(app):
    png = io.BytesIO()
    render(Scene("circle", "red", "blue", "top left"), 64, 64).save(png, "PNG")
    data_url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    image, facts, link = picture_and_facts(call(app, "edit_image", {
        "image": data_url, "prompt": GREEN, "model": "tiny-shapes", "strength": 0.7, "seed": 3}))
    seen = judge(image.convert("RGB"))
    assert image.size == (64, 64) and (seen.colour, seen.background, seen.position) == ("green", "blue", "top left")
    assert facts["edit"] == {"method": "strength", "strength": 0.7, "images": 1, "mask": False, "source": "PNG 64x64"}
    # The green circle just answered, back by its Image URL: red again.
    image, facts, _ = picture_and_facts(call(app, "edit_image", {
        "image": link, "prompt": RED, "model": "tiny-shapes", "strength": 0.7, "seed": 3}))
    assert judge(image.convert("RGB")).colour == "red" and facts["edit"]["source"] == "PNG 64x64"
    outside = refusal(call(app, "edit_image", {"image": app + "/gradio_api/file=/etc/hostname", "prompt": RED}))
    assert outside.startswith("image: ") and "names no picture this server still serves" in outside


@pytest.mark.heavy  # the session's app.py: outside --fast, in the full run
def test_list_models_and_plan_answer_in_the_tools_words(app):
    models = {m["name"]: m for m in json.loads(call(app, "list_models", {}).content[0].text)}
    shapes = models["tiny-shapes"]
    assert shapes["sizes"] == ["64x64", "128x128", "128x64", "64x128"] and shapes["only_these_sizes"]
    assert shapes["modes"]["cpu"]["eager"] == "ok" and shapes["modes"]["cpu"]["compiled"] == "ok"
    assert shapes["edits"] == {"method": "strength", "mask": True} and "none" in shapes["step_caches"]
    planned = json.loads(call(app, "plan", {"model": "flux2-klein-4b", "host": "h100x8"}).content[0].text)
    assert (planned["hardware"], planned["devices"], planned["quantization"]) == ("cuda", 8, "none")
    assert refusal(call(app, "plan", {"model": "flux2-klein-4b", "host": "h100x8", "quantization": "int3"})) \
        .startswith("quantization: quantization='int3' is not accepted: known values are fp8, int8, none")
    assert refusal(call(app, "plan", {"model": "flux2-klein-4b", "host": "h100x9"})).startswith(
        "host: host='h100x9' is not accepted: known values are ")


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """A second app.py --mcp with a line of one waiting request (ACCELDEMO_QUEUE_SIZE=1) behind a bearer token."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("guarded") / "app.log"
    env = {**os.environ, "ACCELDEMO_QUEUE_SIZE": "1", "ACCELDEMO_API_TOKEN": TOKEN}
    with open(log_path, "w") as log:
        process = subprocess.Popen([sys.executable, "app.py", "--port", str(port), "--mcp"], cwd=ROOT, env=env,
                                   stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_answers(url + "/ready", process, log_path)
        yield url
    finally:
        process.terminate()
        process.wait(30)


INITIALIZE = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
    "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "test", "version": "0"}}}
STREAMABLE = {"Accept": "application/json, text/event-stream"}


@pytest.mark.slow
def test_with_an_api_token_the_mcp_server_needs_it(guarded):
    for headers, said in (({}, "needs Authorization: Bearer <key>"), ({"Authorization": "Bearer wrong"}, "not valid"),
                          ({"Authorization": TOKEN}, "must be `Bearer <key>`")):
        answer = httpx.post(guarded + "/gradio_api/mcp/", json=INITIALIZE, headers={**STREAMABLE, **headers})
        assert answer.status_code == 401 and answer.headers["www-authenticate"] == "Bearer", headers
        assert said in answer.json()["detail"], headers
    for path in ("/gradio_api/mcp/schema", f"{TOOLS_MOUNT}/gradio_api/info", f"{TOOLS_MOUNT}/gradio_api/mcp/"):
        assert httpx.get(guarded + path).status_code == 401, path  # the tools' own Gradio app behind it too
    listed = in_session(guarded, ClientSession.list_tools, {"Authorization": f"Bearer {TOKEN}"})
    assert [tool.name for tool in listed.tools] == list(TOOLS)


@pytest.mark.slow
def test_a_burst_past_the_line_gets_the_limit_as_tool_errors(guarded):
    """One request drawing, one waiting (ACCELDEMO_QUEUE_SIZE=1): the rest of a burst of six are refused at once,
    by the engine's line, as MCP tool errors that name the limit, and counted as the line's refusals."""
    headers = {"Authorization": f"Bearer {TOKEN}"}
    warm = call(guarded, "generate_image", {"prompt": RED, "size": "128x128", "steps": 1, "seed": 0}, headers)
    assert not warm.isError, warm.content  # the pipeline loaded, so that the burst meets a running line

    async def burst(session):
        return await asyncio.gather(*(session.call_tool("generate_image", {
            "prompt": RED, "size": "128x128", "steps": 24, "seed": seed}) for seed in range(6)))

    answers = in_session(guarded, burst, headers)
    full = [refusal(answer) for answer in answers if answer.isError]
    served = [answer for answer in answers if not answer.isError]
    assert full and len(served) >= 2, [answer.content[0] for answer in answers]
    assert all(text.startswith("the queue is full: 1 request(s) are already waiting for a device "
                               "(ACCELDEMO_QUEUE_SIZE=1); try again in ") for text in full), full
    status = httpx.get(guarded + "/status", headers=headers).json()
    assert status["counters"]["requests"]["refused"] == len(full)
