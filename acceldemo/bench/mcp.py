"""Section 15: what the MCP door costs — one small request as an MCP tool call (the official mcp client, one session,
streamable HTTP) ÷ the same request over /v1, alternately, to one app.py --mcp on a loopback port; and what progress
notifications add to a call.

Only loopback traffic: the server binds 127.0.0.1 on a free port, and every loop is bounded by a request count.
"""
from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Awaitable, Callable

import httpx

from .figures import Figure, Spread, Target, ratios
from .serving import SHAPE, AppServer, serving_request


async def _interleaved(calls: list[Callable[[], Awaitable[float]]], runs: int) -> list[list[float]]:
    """`figures.interleaved` for coroutines of one event loop (an MCP client session lives in one task)."""
    timings: list[list[float]] = [[] for _ in calls]
    for i in range(runs):
        for j in (range(len(calls)) if i % 2 == 0 else reversed(range(len(calls)))):
            timings[j].append(await calls[j]())
    return timings


class _Doors:
    """One request, as an MCP tool call (with progress notifications or without) and as a /v1 request; each timed end
    to end, with the server's engine seconds from its facts."""

    def __init__(self, request, session, http: httpx.AsyncClient):
        self.session, self.http = session, http
        self.arguments = {"prompt": request.prompt, "model": request.model, "size": str(SHAPE),
                          "steps": request.steps, "seed": request.seed, "mode": str(request.mode)}
        self.body = {"prompt": request.prompt, "model": request.model, "size": str(SHAPE),
                     "num_inference_steps": request.steps, "seed": request.seed, "mode": str(request.mode)}
        self.engine: dict[str, list[float]] = {"mcp": [], "v1": []}
        self.notifications: list[int] = []

    async def mcp(self, progress: bool = False) -> float:
        sent = []

        async def heard(value, total, message) -> None:
            sent.append(value)

        started = time.perf_counter()
        answer = await self.session.call_tool("generate_image", self.arguments,
                                              progress_callback=heard if progress else None)
        seconds = time.perf_counter() - started
        if answer.isError:
            raise RuntimeError(f"generate_image: {answer.content[0].text}")
        self.engine["mcp"].append(json.loads(answer.content[-1].text)["seconds"])
        if progress:
            self.notifications.append(len(sent))
        return seconds

    async def v1(self) -> float:
        started = time.perf_counter()
        answer = await self.http.post("/v1/images/generations", json=self.body)
        answer.raise_for_status()
        seconds = time.perf_counter() - started
        self.engine["v1"].append(answer.json()["acceldemo"][0]["seconds"])
        return seconds


async def _measure(url: str, request, pairs: int) -> tuple[list[float], list[float], list[float], _Doors]:
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    timeout = httpx.Timeout(300)
    async with httpx.AsyncClient(base_url=url, timeout=timeout) as http, \
            httpx.AsyncClient(timeout=timeout) as mcp_http, \
            streamable_http_client(url + "/gradio_api/mcp/", http_client=mcp_http) as (read, write, _), \
            ClientSession(read, write) as session:
        await session.initialize()
        doors = _Doors(request, session, http)
        for _ in range(2):  # loads (and compiles) the pipeline, and every door's first-call costs, untimed
            await doors.mcp(), await doors.v1(), await doors.mcp(progress=True)
        doors.engine = {"mcp": [], "v1": []}
        doors.notifications.clear()
        plain, v1, progress = await _interleaved([doors.mcp, doors.v1, lambda: doors.mcp(progress=True)], pairs)
    return plain, v1, progress, doors


def mcp(bench) -> list[Figure]:
    request = serving_request(bench)
    server = AppServer(None, args=("--mcp",))
    try:
        mcp_s, v1_s, progress_s, doors = asyncio.run(_measure(server.ready(), request, bench.plan.mcp_pairs))
    finally:
        server.close()
    of = statistics.median
    engine = {door: of(seconds) for door, seconds in doors.engine.items()}
    title = f"{request.model} {request.mode} {SHAPE}, {request.steps} steps"
    return [
        Figure("mcp_vs_v1", 15, f"MCP tool call ÷ the same request over /v1 ({title})", "ratio",
               ratios(mcp_s, v1_s), Target("<=", 1.2),
               note=f"{len(mcp_s)} pairs, alternately: MCP {of(mcp_s) * 1000:.0f} ms end to end (the server's engine "
                    f"{engine['mcp'] * 1000:.0f} ms), /v1 {of(v1_s) * 1000:.0f} ms (engine "
                    f"{engine['v1'] * 1000:.0f} ms); ratio of the medians {of(mcp_s) / of(v1_s):.3g}; the PNG "
                    "base64 in both answers",
               detail={"mcp_s": Spread.of(mcp_s).__dict__, "v1_s": Spread.of(v1_s).__dict__,
                       "ratio_of_medians": of(mcp_s) / of(v1_s),
                       "server_engine_s": {door: Spread.of(s).__dict__ for door, s in doors.engine.items()}},
               if_missed="the note splits each door's time between the server's engine and the door around it. "
                         "Beside /v1's work, the MCP SDK opens a session for each request, Gradio builds a session of "
                         "the tools' Blocks, writes the PNG to a file, copies it to its cache, reads it back and "
                         "encodes it again (the arguments' schema check is a validator kept per tool, "
                         "mcp_tools.check_arguments_once): a fixed cost that weighs on a tiny model's call, not a "
                         "real one's"),
        Figure("mcp_progress", 15, f"MCP tool call with progress notifications ÷ without ({title})", "ratio",
               ratios(progress_s, mcp_s), Target("<=", 1.05),
               note=f"{of(doors.notifications):g} notification(s) per call (the first event at once, then the "
                    f"latest at most four times a second): {of(progress_s) * 1000:.0f} ms with, "
                    f"{of(mcp_s) * 1000:.0f} ms without",
               detail={"with_s": Spread.of(progress_s).__dict__, "notifications": Spread.of(doors.notifications)
                       .__dict__},
               if_missed="each notification is one server-sent event on the call's own response, which the client "
                         "parses; mcp_tools.PROGRESS_GAP_S bounds how many a call sends"),
    ]
