"""The backend of an engine whose requests run on this host's devices: one line with one limit for every front end,
replicas supervised, calls shared by requests that can share them, compiled shapes ledgered, resident pipelines
within a budget. Where a pipeline lives (this process, a torchrun pool) is its executor's business."""
from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Callable

from ..config import Settings
from ..errors import AcceldemoError, Cancelled, GenerationFailed, UnsupportedCombination, describe_error
from ..executors.artifacts import ArtifactStore
from ..executors.base import Executor
from ..hardware import HardwareRegistry
from ..models.catalog import get_model
from ..models.download import Downloads
from ..records import VISITOR_TOKEN, Batch, DeviceSet, GenerateResult, Phase, Progress, ReplicaState, Request
from .admission import Line, Ticket
from .batching import BatchPolicy, Member, together
from .compile_times import CompileClock, CompileTimes, compile_kind
from .jobs import Job, Running, admit, never, of_image
from .ledger import CompiledShape, ShapeLedger
from .residency import Residency
from .stats import EngineStats, Kind, outcome_of
from .supervision import Replica, Supervisor
from .validation import local_devices
from .views import DeviceView, PipelineView, ReplicaView

log = logging.getLogger("acceldemo.engine")


class LocalBackend:
    """Requests admitted into this host's line and drawn on its replicas (see `Backend`)."""

    def __init__(self, settings: Settings, hardware: HardwareRegistry, executor: Executor, stats: EngineStats,
                 artifacts: ArtifactStore, node: str):
        self.settings, self.hardware, self.executor, self.stats = settings, hardware, executor, stats
        self.artifacts, self.node = artifacts, node
        self.line = Line(settings.queue_size, settings.device_wait_s, settings.client_queue_limit)
        self.ledger = ShapeLedger(settings.max_shapes_per_pipeline)
        self.compile_times = CompileTimes(settings.cache_dir)
        self.batching = BatchPolicy(settings, hardware, self.ledger)
        self.downloads = Downloads(settings)
        self.residency = Residency(executor, settings.max_resident_pipelines, stats)
        self.supervisor = Supervisor(self.line, self.residency, stats)
        self._calls = itertools.count(1)

    # --- admission --------------------------------------------------------------------------------------------------

    def start(self, job: Job, on_progress, started: float) -> Job:
        request = job.request
        candidates = self._candidates(request)
        members = [Member(part, of_image(i, on_progress), job.cancelled, started, job.visitor_token)
                   for i, part in enumerate(request.members())]

        def image(ticket: Ticket) -> GenerateResult:
            return self.supervisor.attempt(ticket, candidates, started, on_progress, job.cancelled,
                                           lambda ticket, started, queue_wait: self._draw(ticket))

        return self._admit(job, Kind.GENERATE, f"{request.shape} · {request.model} · {request.mode}", candidates,
                           [image] * len(members), lambda parts: GenerateResult.of_images(request, parts),
                           self.batching.sharing(request, job.visitor_token), members)

    def start_warm_up(self, job: Job, warm: list[tuple[Request, int]], on_progress) -> Job:
        """Every replica (or the request's own device), one after the other: the first compiles each shape, the
        others load what it left in the persistent compile caches."""
        base = job.request
        try:
            candidates = self.supervisor.usable(self._candidates(base))
        except AcceldemoError as error:
            self.stats.count(Kind.WARMUP, outcome_of(error))
            raise
        what = f"warm-up of {', '.join(_label(one, size) for one, size in warm)} · {base.model} · {base.mode}"
        admitted = time.perf_counter()

        def warm_replica(ticket: Ticket, started: float, queue_wait: float) -> list[CompiledShape]:
            records, devices = [], ticket.granted
            for i, (one, size) in enumerate(warm, 1):
                on_progress(Progress(Phase.COMPILE, f"warming {_label(one, size)} on {devices} ({i}/{len(warm)})", i,
                                     len(warm)))
                outcome = self._run(devices, [Member(one, on_progress, never, started)], True, size)[0]
                if isinstance(outcome, BaseException):
                    raise outcome
                records.append(self.ledger.record(outcome.key, one.shape, size))
            return records

        def every_replica(ticket: Ticket) -> list[CompiledShape]:
            records = self.supervisor.attempt(ticket, candidates[:1], admitted, on_progress, never, warm_replica)
            for replica in candidates[1:]:
                later = self.line.enter(what, [replica], self._preference(base), admitted=True)
                records += self.supervisor.attempt(later, [replica], time.perf_counter(), on_progress, never,
                                                   warm_replica)
            return records

        return self._admit(job, Kind.WARMUP, what, candidates[:1], [every_replica], lambda parts: parts[0])

    def _admit(self, job: Job, kind: Kind, what: str, candidates: list[DeviceSet],
               bodies: list[Callable[[Ticket], object]], combine: Callable[[list], object], sharing=None,
               members: list[Member] | None = None) -> Job:
        """Enter the line now with one ticket per body, all or none (counting a refusal) — with `sharing`, each
        ticket carrying its member, to be drawn in one call with others —; then run each `body(ticket)` in a thread
        of its own (`jobs.admit`)."""
        return admit(job, kind, self.stats, self.line,
                     lambda: self.line.enter_together(what, self.supervisor.usable(candidates), len(bodies),
                                                      self._preference(job.request), sharing=sharing,
                                                      payloads=members, client=job.client),
                     bodies, combine, lambda ahead: self._retry_after(job.request, ahead, candidates))

    def _retry_after(self, request: Request, ahead: int, candidates: list[DeviceSet]) -> int:
        """Seconds until a device this request could use is likely free: the requests ahead of it for those devices
        (and the ones running on them) at the recent latency of its model and shape, spread over the devices."""
        latency = self.ledger.latency(request.model, request.shape)
        if latency is None:
            latency = max((r.last_latency or 0.0 for r in self.supervisor.replicas().values()), default=0.0)
        return max(1, math.ceil((ahead + 1) * (latency or 1.0) / max(len(candidates), 1)))

    def _candidates(self, request: Request) -> list[DeviceSet]:
        """The device sets a request may run on: the one it names, or the hardware's replicas."""
        if request.devices is not None:
            return [request.devices]
        hardware = self.hardware.get(request.hardware)
        size = local_devices(request.placement, request.world_size, self.settings.pool_nnodes)
        return hardware.device_sets(size)[:self.settings.replicas_of(hardware.name)]

    def _preference(self, request: Request) -> Callable[[DeviceSet], int]:
        """Where a request is best served: its pipeline resident with its shape compiled, then resident, then any."""
        def preference(devices: DeviceSet) -> int:
            key = request.key(devices)
            if not self.residency.is_resident(key):
                return 0
            return 2 if self.ledger.holds(key, request.graph_key) else 1
        return preference

    # --- running on the devices a ticket got ------------------------------------------------------------------------

    def _draw(self, ticket: Ticket) -> GenerateResult:
        """The ticket's image. A rider's comes from the call it was drawn in; a leader draws its own and its riders'
        in one call (after holding it open ACCELDEMO_BATCH_WAIT_MS for more), hands each rider its outcome, and
        returns its own."""
        if ticket.leader is not None:
            return ticket.outcome.result()
        if self.settings.batch_wait_ms and ticket.sharing is not None:
            self.line.gather(ticket, time.monotonic() + self.settings.batch_wait_ms / 1000)
        riders = list(ticket.riders)
        members = [ticket.payload, *(rider.payload for rider in riders)]
        try:
            outcomes = self._run(ticket.granted, members)
        except BaseException as error:  # the call as a whole failed (or its replica was lost): so did every image
            outcomes = [error] * len(members)
        for rider, outcome in zip(riders, outcomes[1:]):
            rider.deliver(outcome)
        if isinstance(outcomes[0], BaseException):
            raise outcomes[0]
        return outcomes[0]

    def _run(self, devices: DeviceSet, members: list[Member], warm_up: bool = False,
             size: int | None = None) -> list[GenerateResult | BaseException]:
        """One pipeline call on `devices` drawing every member not yet stopped (at `size`: a warm-up's bucket; by
        default the batching's size for that many); each member's result, or why it has none."""
        began = time.perf_counter()
        live = [m for m in members if not m.cancelled()]
        unstarted = Cancelled(f"stopped before its call began on {devices}; nothing was started")
        if not live:
            return [unstarted] * len(members)
        batch = Batch(tuple(m.request for m in live),
                      size or self.batching.size(live[0].request, devices, sum(m.request.num_images for m in live)))
        key = batch.first.key(devices)

        def everyone(event: Progress) -> None:
            for member in live:
                member.on_progress(event)

        progress = self.supervisor.following(devices, batch.first.shape, everyone)
        shared = together(len(live) - 1)
        progress(Progress(Phase.QUEUE, f"running on {devices}" + (f", {shared}" if shared else ""), 0))
        served = None
        try:
            if not self.residency.is_resident(key):  # a real model not on this host, fetched when allowed
                self.downloads.ensure(get_model(batch.first.model), lambda fetch: progress(
                    Progress(Phase.LOAD, fetch.describe(), fetch.done, fetch.total, time.perf_counter() - began)))
            resident, load_seconds = self.residency.acquire(key, get_model(batch.first.model), progress)
            try:
                results = self._call(resident.loaded, key, batch, live, progress, warm_up, load_seconds, began)
            finally:
                self.residency.release(resident)
            if not warm_up:
                served = time.perf_counter() - began - load_seconds
        finally:
            self.supervisor.idle(devices, served, len(live))
        drawn = dict(zip(map(id, live), results))
        return [drawn.get(id(m)) or unstarted for m in members]

    def _call(self, loaded, key, batch: Batch, members: list[Member], on_progress, warm_up: bool,
              load_seconds: float, began: float) -> list[GenerateResult | Cancelled]:
        visit = self.ledger.begin(key, batch)
        adapter = self.hardware.get(key.hardware)
        if adapter.lent_per_call and visit.expect_compile and not warm_up:
            # A compile inside a visitor's lent GPU call would spend minutes of their quota: compiled shapes there
            # are the ones warmed up (at start, or by the operator), from a package built then or found in the store.
            self.ledger.abandoned(visit)
            raise UnsupportedCombination("mode", f"{key.mode} {batch.label} has no compiled package on "
                                                 f"{adapter.name} yet: warm it up first (--warmup "
                                                 f"{key.mode}:{batch.first.shape}"
                                                 f"{f'@{batch.size}' if batch.size > 1 else ''}, or the Operator "
                                                 "tab's warm-up)")
        if visit.expect_compile:  # a compiler cache the shared store keeps in step (TPU): what other hosts compiled
            self.artifacts.sync_compiler_cache(adapter, push=False)
        kind = compile_kind(key, batch, adapter.detect().generation)
        clock = CompileClock(on_progress, lambda: self.compile_times.estimate(kind))
        try:
            # A call shared by several stops early only once every one of them is stopped.
            # On lent hardware a call is one visitor's (BatchPolicy.sharing): theirs is the quota charged.
            token = VISITOR_TOKEN.set(members[0].visitor_token)
            try:
                out = loaded.run(batch, visit.expect_compile, clock, lambda: all(m.cancelled() for m in members))
            finally:
                VISITOR_TOKEN.reset(token)
        except AcceldemoError:
            self.ledger.abandoned(visit)
            raise
        except Exception as error:  # a compiler or pipeline failure must not take the server down
            what = describe_error(error)
            self.ledger.failed(visit, what)
            log.exception("generation failed for %s at %s", key, batch.label)
            raise GenerationFailed(f"{key} failed at {batch.label}: {what}") from None
        finally:
            clock.stop()
        if out.new_graphs and clock.measured is not None:
            self.compile_times.record(kind, clock.measured)
        self.artifacts.record(out.package_events, out.store_problem)
        if out.new_graphs:
            self.artifacts.sync_compiler_cache(adapter, push=True)
        self.ledger.finished(visit, out, warm_up)
        call, ended, shared = next(self._calls), time.perf_counter(), len(members)
        results: list[GenerateResult | Cancelled] = []
        spec = get_model(batch.first.model)
        for i, (member, images) in enumerate(zip(members, batch.split(out.images))):
            request = member.request
            result = GenerateResult(
                request=request, key=key, images=images, seconds=ended - member.started,
                queue_wait=began - member.started, load_seconds=load_seconds, compile_seconds=out.compile_seconds,
                new_graphs=out.new_graphs, warm=not visit.first and out.new_graphs == 0,
                compile_cache_hits=out.compile_cache_hits, step_seconds=out.step_seconds,
                preview_seconds=out.preview_seconds,
                unknown_words=spec.unknown_words(request.prompt), note=spec.prompt_note(request.prompt),
                node=self.node, batch=shared, call=call, cache=out.cache, denoise_seconds=out.denoise_seconds,
                weight_bytes=out.weight_bytes, package_events=out.package_events,
                gpu_lease=out.gpu_lease)
            self.stats.observe(result, count_call=i == 0)
            if not member.cancelled():
                results.append(result)
            elif shared > 1 and not all(m.cancelled() for m in members):
                results.append(Cancelled(f"stopped: its image at {request.shape} was dropped from a call "
                                         f"{together(shared - 1)}, which finished for them"))
            else:
                results.append(Cancelled(f"stopped at {request.shape} after {len(out.step_seconds) + 1} of "
                                         f"{request.steps} steps; {key.devices} is free for the next job"))
        return results

    # --- the views --------------------------------------------------------------------------------------------------

    def queue_depth(self) -> int:
        return len(self.line.waiting())

    def busy_devices(self) -> int:
        return len(self.line.running())

    def resident_pipelines(self) -> int:
        return len(self.residency.resident_keys())

    def running(self) -> Running:
        running, waiting = self.line.running(), self.line.waiting()
        residents = self.residency.views()
        resident_keys = [v.key for v in residents if v.resident]
        devices = []
        for device in self.hardware.devices():
            at = (device.hardware, device.index)
            ticket = running.get(at)
            devices.append(DeviceView(device, ticket.what if ticket else None, sum(at in t.devices for t in waiting),
                                      tuple(str(k) for k in resident_keys if k.devices is not None
                                            and k.hardware == device.hardware and device.index in k.devices.indices)))
        known = self.supervisor.replicas()
        sets = {d for hw in self.hardware for d in hw.device_sets(1)[:self.settings.replicas_of(hw.name)]}
        sets |= {k.devices for k in resident_keys if k.devices is not None} | set(known)
        replicas = []
        for devices_set in sorted(sets):
            replica = known.get(devices_set, Replica(devices_set))
            mine = {(devices_set.hardware, i) for i in devices_set.indices}
            if replica.state is ReplicaState.IDLE and mine & set(running):
                state, shown = ReplicaState.BUSY, str(ReplicaState.BUSY)
            else:
                state, shown = replica.state, replica.shown
            replicas.append(ReplicaView(
                devices_set, state, shown, sum(bool(t.devices & mine) for t in waiting),
                tuple(self.ledger.ready_on(devices_set)), replica.served, replica.last_latency, replica.restarts,
                tuple(str(k) for k in resident_keys if k.devices == devices_set), self.node))
        pipelines = tuple(PipelineView(v.key, v.resident, v.busy, v.load_seconds, self.ledger.shapes(v.key))
                          for v in residents)
        return Running(len(waiting), tuple(devices), tuple(replicas), pipelines, tuple(self.downloads.active()))

    def close(self) -> None:
        self.residency.close()
        self.executor.close()


def _label(request: Request, size: int) -> str:
    return Batch((request,), size).label
