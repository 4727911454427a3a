"""A job of the engine as an event loop sees it: submitted at once (admitted or refused before anything waits), its
progress events as they come, then its result. What the page's handler and the /v1 routes both need."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from ..engine import Job
from ..records import Progress, ProgressCallback


class WatchedJob:
    """A job submitted from a coroutine (`submit(on_progress)`, e.g. `lambda p: engine.submit(request, p)`): the
    engine's thread hands each progress event to this loop. A refusal is raised here, before anything waits."""

    def __init__(self, submit: Callable[[ProgressCallback], Job]):
        loop = asyncio.get_running_loop()
        self._events: asyncio.Queue[Progress] = asyncio.Queue()
        self.job = submit(lambda event: loop.call_soon_threadsafe(self._events.put_nowait, event))
        self._done = asyncio.wrap_future(self.job.future)

    def cancel(self) -> None:
        self.job.cancel()

    @property
    def done(self) -> bool:
        return self._done.done()

    async def events(self, tick_s: float | None = None) -> AsyncIterator[Progress | None]:
        """Each progress event until the job ends; with `tick_s`, also None whenever that long passed without one
        (so the caller can look at its client meanwhile)."""
        while not (self._done.done() and self._events.empty()):
            if not self._events.empty():
                yield self._events.get_nowait()
                continue
            getter = asyncio.ensure_future(self._events.get())
            finished, _ = await asyncio.wait({getter, self._done}, timeout=tick_s,
                                             return_when=asyncio.FIRST_COMPLETED)
            if getter in finished:
                yield getter.result()
            else:
                getter.cancel()
                if not finished:
                    yield None

    async def result(self):
        """The result, or the job's error; the job is stopped if the awaiting task is cancelled."""
        try:
            return await asyncio.shield(self._done)
        except asyncio.CancelledError:
            self.job.cancel()
            raise
