"""One rank of the tensor-parallel worker pool; rank 0 also serves the app's authenticated channel.

Launched by the pool executor (or, on further nodes, by an operator) as
`python -m torch.distributed.run --nproc_per_node=N -m acceldemo.executors.worker --hardware HW [--devices HW:I-J]
[--socket PATH]`.
Rank 0 takes one command (`Load`, `Run`, `Unload`, `Status`, `Shutdown`) at a time from the app, fans it out to every
rank with `broadcast_object_list` on a gloo control group, runs its own share, learns every rank's outcome with
`all_gather_object`, and answers: `Reported` progress events, then `Done` | `Failed` | `Broken` — after `Broken`
the process group is unusable and the ranks exit, so torchrun ends and the app restarts the pool. While a `Run` is in
flight the app may send `Cancel`, which stops it at its next denoise step.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import logging
import os
import queue
import select
import shutil
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from ..config import PoolLaunch, Settings
from ..errors import describe_error
from ..models.catalog import ModelSpec
from ..records import Batch, DeviceSet, Phase, PipelineKey, Placement, Progress, RunOutput, no_progress, placement_label
from .replies import Broken, Done, Failed, Reply, Reported, portable_error

# Rank 0 fans out a no-op this often while idle: waiting ranks never reach the group timeout, and a dead peer
# breaks the group (and so the pool) even when nobody is asking for images.
HEARTBEAT_S = 10.0
# Exit status of a rank that left because the app that started the pool is gone.
EXIT_APP_GONE = 3

log = logging.getLogger("acceldemo.worker")


# --- what the app sends rank 0, which fans every command but Cancel out to all ranks ----------------------------

@dataclass(frozen=True)
class Status:
    """Each rank reports itself (`RankInfo`)."""


@dataclass(frozen=True)
class Load:
    """Load a pipeline (sharded over the ranks when there are several) under the app's id for it."""

    pipeline: str
    key: PipelineKey
    spec: ModelSpec


@dataclass(frozen=True)
class Run:
    """Checked requests drawn together in one pipeline call, on every rank; rank 0's images come back (pixel arrays
    either way: uint8 for output_type "pil", floats for "np")."""

    pipeline: str
    batch: Batch
    expect_compile: bool
    output_type: str = "pil"
    # Rank 0 profiles the call and reports the seconds it spent in collectives (the bench's communication share).
    profile: bool = False


@dataclass(frozen=True)
class Unload:
    pipeline: str


@dataclass(frozen=True)
class Shutdown:
    """Every rank leaves; torchrun ends."""


@dataclass(frozen=True)
class Heartbeat:
    """Rank 0's own no-op while idle (never sent by the app)."""


@dataclass(frozen=True)
class Cancel:
    """Stop the running request at its next denoise step (read by rank 0 only, while a Run is in flight)."""


Command = Status | Load | Run | Unload | Shutdown | Heartbeat


# --- what rank 0 answers ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RankInfo:
    """One rank as it reports itself: who and where it is and what it holds."""

    rank: int
    local_rank: int
    pid: int
    host: str
    device: str
    pipelines: tuple[str, ...] = ()
    sharded: dict = field(default_factory=dict)  # pipeline -> [ShardedComponent]


class Channel:
    """Rank 0's end of the app's channel: a Unix socket; a client is served only after the HMAC handshake.

    `multiprocessing.connection.Listener(authkey=...)` sends a challenge and checks the client's digest of it with
    raw byte reads before it hands out a connection, so nothing a client sends is unpickled before it has proved
    it holds the pool's secret. Accepting runs in a thread so rank 0 keeps its heartbeat while no app is connected.
    """

    def __init__(self, address: str, authkey: bytes):
        from multiprocessing.connection import Listener

        self.listener = Listener(address, family="AF_UNIX", authkey=authkey)
        self.arrivals: queue.Queue = queue.Queue()
        self.client = None
        self.cancel_asked = False
        threading.Thread(target=self._accept, name="channel-accept", daemon=True).start()

    def _accept(self) -> None:
        from multiprocessing import AuthenticationError

        while True:
            try:
                self.arrivals.put(self.listener.accept())
            except (AuthenticationError, EOFError, OSError) as error:
                log.warning("refused a client of the pool channel: %s", describe_error(error))

    def next_command(self, wait_s: float) -> Command | None:
        """The app's next command, or None after `wait_s` without one."""
        deadline = time.monotonic() + wait_s
        while (left := deadline - time.monotonic()) > 0:
            self._adopt_newest()
            if self.client is None:
                try:
                    self.client = self.arrivals.get(timeout=min(left, 0.5))
                except queue.Empty:
                    pass
                continue
            try:
                if self.client.poll(min(left, 0.5)):
                    command = self.client.recv()
                    if isinstance(command, Command):  # a Cancel arriving after its Run ended is dropped
                        return command
            except (EOFError, OSError):
                self.client = None
        return None

    def _adopt_newest(self) -> None:
        # The app connects once per pool; a newer authenticated client means the old one is gone.
        while not self.arrivals.empty():
            if self.client is not None:
                self.client.close()
            self.client = self.arrivals.get()

    def send(self, reply: Reply) -> None:
        if self.client is None:
            return
        try:
            self.client.send(reply)
        except (OSError, ValueError):
            self.client = None

    def progress(self, event: Progress) -> None:
        self.send(Reported(event))

    def take_cancel(self) -> bool:
        """Whether the app asked to stop the running request (read without waiting)."""
        try:
            while self.client is not None and self.client.poll(0):
                self.cancel_asked |= isinstance(self.client.recv(), Cancel)
        except (EOFError, OSError):
            self.client = None
        return self.cancel_asked


class Rank:
    """What every rank holds and does: its process groups, its mesh, the pipelines it has loaded."""

    def __init__(self, hardware, settings: Settings, channel: Channel | None):
        """Joins the process group: every rank of the pool must construct its Rank."""
        import datetime

        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh

        timeout = datetime.timedelta(seconds=settings.pool_timeout_s)
        dist.init_process_group(hardware.dist_backend, timeout=timeout)
        self.dist = dist
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        # Commands travel on their own CPU group, so they never queue behind (or between) the model's collectives.
        self.control = dist.new_group(backend="gloo", timeout=timeout)
        self.mesh = DeviceMesh(hardware.mesh_device_type, list(range(self.world_size)))
        self.hardware = hardware
        self.settings = settings
        self.channel = channel
        self.pipelines: dict[str, object] = {}  # id -> PreparedPipeline
        self.sharded: dict[str, list] = {}

    # --- the loop -------------------------------------------------------------------------------------------

    def serve(self) -> int:
        """Rank 0: take commands from the app, fan them out, answer. Returns the exit status."""
        while True:
            command = self.channel.next_command(HEARTBEAT_S) or Heartbeat()
            self.channel.cancel_asked = False
            try:
                self._fan_out(command)
                value, error = self._execute(command)
                outcomes = self._gather(self._outcome(command, value, error))
            except Exception as broken:  # the group itself failed: a peer died or the network went
                what = type(command).__name__
                log.error("process group broken during %s: %s", what, describe_error(broken))
                self.channel.send(Broken(f"during {what}: {describe_error(broken)}"))
                return 1
            if not isinstance(command, Heartbeat):
                self._answer(command, value, outcomes)
            if isinstance(command, Shutdown):
                return 0

    def follow(self) -> int:
        """Every other rank: run what rank 0 fans out, in the same order."""
        while True:
            command = self._fan_out(None)
            value, error = self._execute(command)
            self._gather(self._outcome(command, value, error))
            if isinstance(command, Shutdown):
                return 0

    def _fan_out(self, command: Command | None) -> Command:
        box = [command]
        self.dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def _gather(self, outcome) -> list:
        outcomes = [None] * self.world_size
        self.dist.all_gather_object(outcomes, outcome, group=self.control)
        return outcomes

    def _cancelled(self) -> bool:
        """Asked by every rank at every step end: rank 0's answer (did the app cancel?) reaches all of them. A pool of
        one rank (a replica) has nobody to tell: a broadcast there would only add its cost to every step."""
        asked = self.channel.take_cancel() if self.channel else False
        if self.world_size == 1:
            return asked
        # One byte as a tensor: a broadcast of a pickled object costs two collectives (its size, then its bytes),
        # about 0.6 ms on gloo against 0.25 ms, at every step of every call.
        import torch

        flag = torch.tensor([asked], dtype=torch.uint8)
        self.dist.broadcast(flag, src=0, group=self.control)
        return bool(flag.item())

    # --- the commands ---------------------------------------------------------------------------------------

    def _execute(self, command: Command) -> tuple[object, BaseException | None]:
        try:
            return self._handlers[type(command)](self, command), None
        except Exception as error:  # a bad request: every rank reports, the pool keeps serving
            log.exception("%s failed on rank %d", type(command).__name__, self.rank)
            return None, error

    def _nothing(self, command: Heartbeat | Shutdown) -> None:
        return None

    def _status(self, command: Status) -> RankInfo:
        return self._info()

    def _load(self, command: Load) -> list:
        from ..models.loading import load_pipeline
        from ..models.tensor_parallel import load_sharded_pipeline
        from .artifacts import ArtifactStore
        from .parallel import enable_context_parallel, split_work
        from .recipe import apply_recipe, precompiles

        key, spec = command.key, command.spec
        progress = self.channel.progress if self.channel else no_progress
        started = time.perf_counter()
        how = {Placement.TP: f"sharded over {self.world_size} ranks",
               Placement.CFG: f"whole on each of {self.world_size} ranks, one guidance branch each",
               Placement.CP: f"whole on each of {self.world_size} ranks, the image tokens spread over them"}
        progress(Progress(Phase.LOAD, f"loading {spec.title} {how[key.placement]}" if self.world_size > 1
                          else f"loading {spec.title}"))
        if key.placement is Placement.TP:
            pipe, sharded = load_sharded_pipeline(spec, self.settings, self.mesh, key.quantization)
        else:
            pipe, sharded = load_pipeline(spec, self.settings, key.quantization), []
        pipe.set_progress_bar_config(disable=True)
        if key.placement is Placement.CP:
            enable_context_parallel(pipe, key.cp_size, self.hardware.mesh_device_type)
        where = f"{key.mode}, {placement_label(key.placement, key.tp_size, key.cp_size)}" if self.world_size > 1 \
            else str(key.mode)
        progress(Progress(Phase.LOAD, f"placing on {key.devices} ({where})", elapsed=time.perf_counter() - started))
        # A whole pipeline (a pool of one rank: a replica) uses the host's precompiled packages like the app does;
        # sharded transformers cannot be exported into one.
        store = ArtifactStore.of(self.settings) if self.world_size == 1 and precompiles(
            self.settings, self.hardware, key.mode, key.placement, key.quantization) else None
        # The rank sees only its own devices: the first visible one is its device.
        prepared = apply_recipe(pipe, self.hardware, key.mode, key.placement, self.settings, spec, store,
                                self.hardware.torch_device(DeviceSet(self.hardware.name, (0,))))
        split_work(prepared.seam(), key.placement, self.rank, self.world_size)
        self.pipelines[command.pipeline] = prepared
        self.sharded[command.pipeline] = sharded
        return sharded

    def _run(self, command: Run) -> RunOutput | None:
        from .recipe import recompile_limits, run_pipeline

        pipe = self._pipeline(command.pipeline)
        progress = self.channel.progress if self.channel else no_progress
        profiled = command.profile and self.rank == 0
        with _CollectivesTimed() if profiled else contextlib.nullcontext() as collectives:
            out = run_pipeline(pipe, self.hardware, command.batch, command.expect_compile, progress, self._cancelled,
                               output_type=command.output_type, limits=recompile_limits(self.settings),
                               cache_dir=self.settings.cache_dir if self.rank == 0 else None)  # rank 0 reports
        if self.rank != 0:
            return None  # only rank 0 answers the app
        if profiled:
            out = dataclasses.replace(out, collective_seconds=collectives.seconds)
        # Pixels as arrays: over a local socket a copy of the bytes costs less than a PNG's encode and decode.
        images = [np.asarray(image) for image in out.images] if command.output_type == "pil" else list(out.images)
        return dataclasses.replace(out, images=images)

    def _unload(self, command: Unload) -> None:
        self.pipelines.pop(command.pipeline, None)
        self.sharded.pop(command.pipeline, None)
        gc.collect()
        self.hardware.empty_cache()

    _handlers = {Heartbeat: _nothing, Shutdown: _nothing, Status: _status, Load: _load, Run: _run, Unload: _unload}

    def _pipeline(self, pipeline: str):
        try:
            return self.pipelines[pipeline]
        except KeyError:
            raise KeyError(f"pipeline {pipeline!r} is not loaded on rank {self.rank}") from None

    # --- answers --------------------------------------------------------------------------------------------

    def _info(self) -> RankInfo:
        return RankInfo(self.rank, self.local_rank, os.getpid(), socket.gethostname(), self.hardware.device,
                        tuple(self.pipelines), dict(self.sharded))

    def _outcome(self, command: Command, value, error: BaseException | None) -> tuple:
        """What rank 0 learns from every rank: its error (the exception itself, so the app sees its type, e.g. an
        out-of-memory one), or after a load its shard counts, after status its report."""
        if error is not None:
            return portable_error(error), None
        return None, value if isinstance(command, Load | Status) else None

    def _answer(self, command: Command, value, outcomes: list) -> None:
        failed = [(rank, error) for rank, (error, _) in enumerate(outcomes) if error is not None]
        if failed:
            rank, error = failed[0]
            log.error("%s failed on rank(s) %s; answering with rank %d's %s", type(command).__name__,
                      ", ".join(str(r) for r, _ in failed), rank, describe_error(error))
            self.channel.send(Failed(error))
            return
        if isinstance(command, Load):
            for rank, (_, sharded) in enumerate(outcomes if self.world_size > 1 else ()):
                shown = ", ".join(str(s) for s in sharded)
                self.channel.progress(Progress(Phase.LOAD, f"rank {rank} loaded: {shown} parameters sharded"
                                               if sharded else f"rank {rank} loaded the whole pipeline"))
            value = [sharded for _, sharded in outcomes]
        elif isinstance(command, Status):
            value = [info for _, info in outcomes]
        self.channel.send(Done(value))


class _CollectivesTimed(contextlib.AbstractContextManager):
    """torch.profiler around one call: the seconds in which this rank had a collective in flight, launched and not yet
    complete. The profiler records a collective as `c10d::<op>` or `_c10d_functional::<op>` for its launch (and
    `_c10d_functional::wait_tensor` for a functional one's wait), and as `<backend>:<op>` (`gloo:all_gather`) from
    launch to completion, the wait for the slower rank included. Their spans are merged, so nested or overlapping ones
    count once."""

    BACKENDS = ("gloo:", "nccl:", "xla:", "neuron:")

    def __enter__(self) -> _CollectivesTimed:
        from torch.profiler import ProfilerActivity, profile

        self.seconds = 0.0
        self._profile = profile(activities=[ProfilerActivity.CPU])
        self._profile.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._profile.__exit__(*exc)
        spans = sorted((event.time_range.start, event.time_range.end) for event in self._profile.events()
                       if "c10d" in event.name or event.name.startswith(self.BACKENDS))
        covered_us, reached = 0.0, float("-inf")
        for begin, finish in spans:  # by start: each span counts only past what earlier spans covered
            covered_us += max(0.0, finish - max(begin, reached))
            reached = max(reached, finish)
        self.seconds = covered_us / 1e6


def _exit_with(app_pid: int, folder: str | None) -> None:
    """Leave as soon as the app that started the pool is gone (crashed, killed, or exited without closing it).

    Rank 0 also removes the pool's private folder (its socket, torchrun's log): nobody else is left to.
    """
    def leave() -> None:
        log.error("the app (pid %d) is gone: leaving", app_pid)
        if folder:
            shutil.rmtree(folder, ignore_errors=True)
        os._exit(EXIT_APP_GONE)

    def watch() -> None:
        try:
            descriptor = os.pidfd_open(app_pid)
        except ProcessLookupError:
            leave()
        except (AttributeError, OSError):
            while _alive(app_pid):
                time.sleep(0.5)
            leave()
        select.select([descriptor], [], [])
        leave()

    threading.Thread(target=watch, name="app-watchdog", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _die_with_launcher() -> None:
    """Ask Linux to kill this rank if torchrun's agent (its parent) dies without stopping it."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    from ..hardware import HardwareRegistry, hardware_names, prepare_process

    parser = argparse.ArgumentParser(prog="python -m acceldemo.executors.worker", description=__doc__)
    parser.add_argument("--hardware", required=True, choices=hardware_names())
    parser.add_argument("--devices", type=DeviceSet.parse,
                        help="the devices this node's ranks own, e.g. neuron:4-7 (default: the first N)")
    parser.add_argument("--socket", help="rank 0's channel (Unix socket path); set by the app on its own node")
    args = parser.parse_args(argv)
    # Read and dropped before anything else runs, so no child of a rank (compiler workers) inherits the secret.
    launch = PoolLaunch.take_from_environment()
    prepare_process(launch.settings)
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    _die_with_launcher()
    if launch.app_pid:
        _exit_with(launch.app_pid, os.path.dirname(args.socket) if rank == 0 and args.socket else None)

    hardware = HardwareRegistry(launch.settings).get(args.hardware)
    devices = args.devices or DeviceSet(hardware.name, tuple(range(int(os.environ.get("LOCAL_WORLD_SIZE", 1)))))
    # Before torch is imported: an adapter may choose the rank's core through the environment (Neuron).
    hardware.prepare_rank(local_rank, devices)
    hardware.activate()
    if rank == 0 and not (args.socket and launch.authkey):
        parser.error("rank 0 needs --socket and the pool's secret from the app that starts it")
    channel = Channel(args.socket, launch.authkey) if rank == 0 else None
    worker = Rank(hardware, launch.settings, channel)
    log.info("rank %d of %d up (pid %d, %s)", worker.rank, worker.world_size, os.getpid(), hardware.name)
    status = worker.serve() if worker.rank == 0 else worker.follow()
    if status == 0:
        worker.dist.destroy_process_group()
    return status


if __name__ == "__main__":
    # Run as the imported module, not as __main__: the app pickles this module's commands (`Load`, `Run`, ...), and
    # isinstance checks must see those classes rather than __main__ twins of them.
    from acceldemo.executors.worker import main as imported_main

    sys.exit(imported_main())
