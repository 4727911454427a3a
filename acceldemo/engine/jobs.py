"""What the engine's front door hands to a backend (`Job`), and what it asks of one (`Backend`): the engine checks,
answers repeats from its result cache, and counts; a backend admits and runs — on this host's devices
(`LocalBackend`), or on a fleet's replicas (`FleetBackend`). The builder picks one, once."""
from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

from ..errors import AcceldemoError, Cancelled, GenerationFailed, QueueFull, describe_error
from ..records import ProgressCallback, Request
from .admission import Line, Ticket
from .stats import EngineStats, Kind, Outcome, outcome_of
from .views import DeviceView, PipelineView, ReplicaView

log = logging.getLogger("acceldemo.engine")


def never() -> bool:
    return False


class Job:
    """One admitted request, running in a thread of its own: `future` gets its result (or its error); `cancel()`
    stops it at its next denoise step, or takes it out of the line."""

    def __init__(self, request: Request, cancelled: Callable[[], bool] = never, client: str = "",
                 visitor_token: str | None = None):
        self.request, self.client, self.visitor_token = request, client, visitor_token
        self.future: Future = Future()
        self._stop = threading.Event()
        self._asked = cancelled

    def cancel(self) -> None:
        self._stop.set()

    def cancelled(self) -> bool:
        return self._stop.is_set() or self._asked()

    def result(self, timeout: float | None = None):
        return self.future.result(timeout)


def of_image(image: int, on_progress: ProgressCallback) -> ProgressCallback:
    """`on_progress` for one image of a request: its events say which image they are about."""
    if image == 0:
        return on_progress
    return lambda event: on_progress(dataclasses.replace(event, image=image))


def run_together(job: Job, kind: Kind, stats: EngineStats, bodies: list[Callable[[], object]],
                 combine: Callable[[list], object], after: Callable[[int], None]) -> Job:
    """Each body in a thread of its own (then `after(i)`, whatever happened); the job's result is `combine` of
    theirs, in order, or its first failure (a bug becomes GenerationFailed, and the others are stopped); its outcome
    is counted once, when the last one ends."""
    results: list = [None] * len(bodies)
    failures: list[BaseException] = []
    left = [len(bodies)]
    lock = threading.Lock()

    def finish() -> None:
        if failures:
            error = next((f for f in failures if not isinstance(f, Cancelled)), failures[0])
            stats.count(kind, outcome_of(error))
            job.future.set_exception(error)
            return
        try:
            job.future.set_result(combine(results))
            stats.count(kind, Outcome.OK)
        except BaseException as error:  # a bug must reach the person as a message, never hang a front end
            log.exception("%s failed", kind)
            stats.count(kind, Outcome.FAILED)
            job.future.set_exception(GenerationFailed(f"internal error: {describe_error(error)}"))

    def run(i: int, body: Callable[[], object]) -> None:
        try:
            results[i] = body()
        except BaseException as error:
            if not isinstance(error, AcceldemoError):
                log.exception("%s failed", kind)
                error = GenerationFailed(f"internal error: {describe_error(error)}")
            with lock:
                failures.append(error)
            job.cancel()  # the request has failed: its other images stop at their next step, or leave the line
        finally:
            after(i)
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                finish()

    for i, body in enumerate(bodies):
        threading.Thread(target=run, args=(i, body), name=f"{kind}-{i}", daemon=True).start()
    return job


def admit(job: Job, kind: Kind, stats: EngineStats, line: Line, enter: Callable[[], list[Ticket]],
          bodies: list[Callable[[Ticket], object]], combine: Callable[[list], object],
          retry_after: Callable[[int], int]) -> Job:
    """A backend's admission: `enter()` takes one ticket per body from the line, all or none. A refusal is counted
    and raised; a full line (QueueFull, or the client's ClientQueueFull) again with `retry_after(ahead)`, the backend's
    own estimate. Then each `body(ticket)` runs in a thread of its own (`run_together`), its ticket released after it
    (a no-op where the body released it; it frees one whose body never started)."""
    try:
        tickets = enter()
    except QueueFull as full:
        stats.count(kind, Outcome.REFUSED)
        raise type(full)(full.waiting, full.limit, full.ahead, retry_after(full.ahead)) from None
    except AcceldemoError as error:
        stats.count(kind, outcome_of(error))
        raise
    runs = [lambda body=body, ticket=ticket: body(ticket) for body, ticket in zip(bodies, tickets, strict=True)]
    return run_together(job, kind, stats, runs, combine, lambda i: line.release(tickets[i]))


@dataclass(frozen=True)
class Running:
    """A backend's part of the engine's snapshot: what waits, the devices, replicas and pipelines, the downloads."""

    queue_depth: int
    devices: tuple[DeviceView, ...]
    replicas: tuple[ReplicaView, ...]
    pipelines: tuple[PipelineView, ...] = ()
    downloads: tuple[dict, ...] = ()


class Backend(Protocol):
    """Where checked requests are admitted and run. Each start method admits at once or raises (QueueFull, or a
    typed error), counting the refusal; once admitted, the job's outcome is counted exactly once."""

    def start(self, job: Job, on_progress: ProgressCallback, started: float) -> Job:
        """Draw `job.request`'s images; the job's result is the request's `GenerateResult`."""

    def start_warm_up(self, job: Job, warm: list[tuple[Request, int]], on_progress: ProgressCallback) -> Job:
        """Compile each (one-step request, batch size) ahead of requests; the result: the `CompiledShape` records."""

    def queue_depth(self) -> int:
        """Requests waiting (running ones not counted)."""

    def busy_devices(self) -> int: ...

    def resident_pipelines(self) -> int: ...

    def running(self) -> Running: ...

    def close(self) -> None:
        """Stop what it started: its pipelines, processes, or the fleet's handle."""
