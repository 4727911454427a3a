"""Requests drawn together: which waiting requests may share one pipeline call, how many one call on a device set
takes (ACCELDEMO_MAX_BATCH, else the model's cap within the device's memory), and at which batch size it runs (in a
compiled mode one of the buckets its graphs are built for)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..config import Settings
from ..executors.recipe import BUCKETS
from ..hardware import HardwareRegistry
from ..models.catalog import get_model
from ..records import DeviceSet, ProgressCallback, Request
from .admission import Sharing
from .ledger import ShapeLedger
from .validation import batch_fit


@dataclass(frozen=True)
class Member:
    """One request of a pipeline call (alone, or drawn with others), with what stays its own: its progress, its stop
    flag, its clock (`started`: perf_counter seconds when it was submitted)."""

    request: Request
    on_progress: ProgressCallback
    cancelled: Callable[[], bool]
    started: float
    # The platform's token for the visitor it draws for (`records.VISITOR_TOKEN`).
    visitor_token: str | None = None


def together(others: int) -> str:
    """What a person reads of a shared call: `drawn together with 3 other requests`; "" for a call of its own."""
    if others < 1:
        return ""
    return f"drawn together with {others} other request{'s' if others > 1 else ''}"


class BatchPolicy:
    """How many requests of one kind one call takes, per device set, and the batch size it then runs at."""

    def __init__(self, settings: Settings, hardware: HardwareRegistry, ledger: ShapeLedger):
        self.settings, self.hardware, self.ledger = settings, hardware, ledger

    def sharing(self, request: Request, visitor_token: str | None = None) -> Sharing | None:
        """How the request's tickets share calls in the line; None when batching is off (ACCELDEMO_MAX_BATCH=1), and
        for a request asking for previews (a call's previews are of its first picture: no one sees another's), and for
        an edit (its picture is its own). On hardware lent per call (ZeroGPU) a call is charged to one visitor's
        quota, so it draws only for requests of the same visitor (`visitor_token`)."""
        if self.settings.max_batch == 1 or request.previews or request.edit is not None:
            return None
        key = request.batch_key
        if self.hardware.get(request.hardware).lent_per_call:
            key = (key, visitor_token)
        return Sharing(key, lambda devices, n: self.take(request, devices, n))

    def bucketed(self, request: Request) -> bool:
        """Whether a call's batch size is part of what is compiled: compiled modes, and hardware where every new
        shape compiles (Neuron, TPU)."""
        return request.mode.compiles or self.hardware.get(request.hardware).every_shape_compiles

    def sizes(self, request: Request, devices: DeviceSet) -> list[int]:
        """The batch sizes one call of this request's pipeline may run at on these devices, smallest first.

        At most ACCELDEMO_MAX_BATCH, else the model's cap within the device's memory at this shape. Bucketed calls run
        at the buckets (1, 2, 4, and the cap); where each is one more compile even eagerly (Neuron, TPU), only at
        batch 1 and the buckets a warm-up compiled.
        """
        hardware = self.hardware.get(request.hardware)
        cap = self.settings.max_batch or batch_fit(get_model(request.model), hardware.detect().memory_bytes,
                                                   request.placement, request.tp_size, request.shape)
        if not self.bucketed(request):
            return list(range(1, cap + 1))
        sizes = sorted({b for b in BUCKETS if b < cap} | {cap})
        if hardware.every_shape_compiles:
            key = request.key(devices)
            sizes = [b for b in sizes if b == 1 or self.ledger.holds(key, request.graph.key(request.shape, b,
                                                                                            request.guidance))]
        return sizes

    def take(self, request: Request, devices: DeviceSet, waiting: int) -> int:
        """How many of `waiting` requests that could share a call (this one included) one call takes.

        Up to the largest size. A count between two buckets runs at the next bucket, padded — or, where the ledger
        has measured both, as the smaller bucket now and the rest in the next call, when that is cheaper.
        """
        sizes = self.sizes(request, devices)
        n = min(waiting, sizes[-1])
        if n in sizes:
            return n
        up, down = min(b for b in sizes if b > n), max(b for b in sizes if b < n)
        rest = min(b for b in sizes if b >= n - down)
        key, shape = request.key(devices), request.shape
        padded, first, second = (self.ledger.warm_latency(key, shape, b) for b in (up, down, rest))
        if padded and first and second and first + second < padded:
            return down
        return n

    def size(self, request: Request, devices: DeviceSet, count: int) -> int:
        """The batch size a call of `count` requests runs at: `count`, or the next bucket (padded)."""
        return min((b for b in self.sizes(request, devices) if b >= count), default=count)
