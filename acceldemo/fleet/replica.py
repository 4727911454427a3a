"""One pipeline replica of the fleet: a Ray Serve replica holding an engine of its own over the devices Ray gave it
(one device set), answering one image at a time as a stream — where it runs, its progress, then its result."""
from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import threading
import time
from dataclasses import dataclass

from ray import serve

from ..builder import build_engine
from ..config import Settings
from ..engine import CompiledShape
from ..errors import AcceldemoError, GenerationFailed
from ..executors.replies import Done, Failed, Reported, portable_error
from ..hardware import prepare_process
from ..records import Request, Shape, placement_label

_DONE = object()  # the engine's job has its outcome


@dataclass(frozen=True)
class RoutingKey:
    """What a replica holds that makes it the best place for a request: its pipeline compiled at its shape. Serve's
    multiplexed model id is its text (`str`), read back with `parse`."""

    model: str
    hardware: str
    mode: str
    placement: str
    shape: Shape

    _SEPARATOR = "|"

    @classmethod
    def of(cls, request: Request) -> RoutingKey:
        return cls(request.model, request.hardware, str(request.mode),
                   placement_label(request.placement, request.tp_size, request.cp_size), request.shape)

    def __str__(self) -> str:
        return self._SEPARATOR.join((self.model, self.hardware, self.mode, self.placement, str(self.shape)))

    @classmethod
    def parse(cls, text: str) -> RoutingKey | None:
        """The key a replica reported holding; None for text that is not one."""
        parts = text.split(cls._SEPARATOR)
        shape = Shape.parse(parts[-1]) if len(parts) == 5 else None
        return None if shape is None else cls(*parts[:4], shape)


def routing_key(request: Request) -> str:
    """Serve's multiplexed model id for a request: its `RoutingKey` as text."""
    return str(RoutingKey.of(request))


@dataclass(frozen=True)
class Started:
    """The first item of a replica's answer: which replica of which node took the image."""

    node: str
    replica: str




class PipelineReplica:
    """A Serve replica: an engine over this actor's devices (one device set: Ray pins the process to the devices it
    asked for, the CPU cores through OMP_NUM_THREADS), its own line of one. It tells the router which pipelines and
    shapes it holds (`hold`, multiplexed) and what it has done (`record_routing_stats`)."""

    def __init__(self, settings_json: str, hardware: str, model: str | None = None):
        settings = Settings.from_json(settings_json)
        # This replica is one device of its hardware, whatever the app's host had.
        settings = dataclasses.replace(settings, replicas={hardware: 1}, cpu_devices=1, ray_address=None)
        prepare_process(settings)
        import ray

        context = serve.get_replica_context()
        self.replica = context.replica_id.unique_id
        self.node = f"{socket.gethostname()}/{ray.get_runtime_context().get_node_id()[:12]}"
        self.engine = build_engine(settings, node=self.node)
        self.hardware = hardware
        # Serve routes to a replica once it is constructed: it comes up holding the app's model (one eager step at
        # the model's default size), so a new replica's first visitor does not wait for the model to load.
        from ..records import GenerateParams

        self.engine.warm_up(GenerateParams(prompt="warm-up", model=model, hardware=hardware, mode="eager"))
        self.served = 0
        self.last_latency: float | None = None
        self.busy = ""

    @serve.multiplexed(max_num_models_per_replica=64)
    async def hold(self, key: str) -> str:
        # The engine loads and compiles on the first request itself; holding a key only tells Serve's router so.
        return key

    def record_routing_stats(self) -> dict:
        return {"node": self.node, "hardware": self.hardware, "served": self.served,
                "last_latency": self.last_latency, "busy": self.busy, "pid": os.getpid()}

    async def generate(self, request: Request):
        """The executors' reply protocol (`executors.replies`) after `Started`: each progress event `Reported`, then
        `Done` with the image's result, or `Failed` with the engine's typed error (a Ray error wrapper would lose its
        type)."""
        await self.hold(serve.get_multiplexed_model_id())
        yield Started(self.node, self.replica)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def put(item: object) -> None:  # from the engine's threads, in order
            loop.call_soon_threadsafe(events.put_nowait, item)

        stop = threading.Event()
        self.busy = f"{request.shape} · {request.model}"
        try:
            job = self.engine.submit(request, put, stop.is_set)
            job.future.add_done_callback(lambda _: put(_DONE))
            while (item := await events.get()) is not _DONE:
                yield Reported(item)
            result = job.result()
        except AcceldemoError as error:
            yield Failed(portable_error(error, GenerationFailed))
            return
        except BaseException:
            stop.set()  # the caller went away (cancelled): stop at the next denoise step
            raise
        finally:
            self.busy = ""
        self.served += 1
        self.last_latency = result.seconds - result.queue_wait
        yield Done(result)

    async def warm_up(self, request: Request, shapes: list[Request]) -> list[CompiledShape]:
        await self.hold(serve.get_multiplexed_model_id())
        started = time.perf_counter()
        # The request as the front door checked it, every field included: the replica warms the very pipeline
        # (quantization, step cache, style) it will then serve.
        records = await asyncio.to_thread(self.engine.warm_up, request, [r.shape for r in shapes])
        self.last_latency = self.last_latency or time.perf_counter() - started
        return records

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()

