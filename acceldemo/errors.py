"""Typed errors a person can act on: raised in the engine, shown unchanged by UI, CLI and API."""
from __future__ import annotations

from collections.abc import Iterable
from enum import Enum


class AcceldemoError(Exception):
    """Base of every error the product shows to a person; its message is the whole story."""

    field: str | None = None


class InvalidRequest(AcceldemoError):
    """A request field holds a value that is not accepted; names the field, the value and what is."""

    def __init__(self, field: str, value: object, accepted: str):
        self.field = field
        self.value = value
        self.accepted = accepted
        if isinstance(value, Enum):  # a name as a person writes it
            value = value.value
        shown = repr(value) if not isinstance(value, str) or len(value) <= 60 else repr(value[:57] + "...")
        super().__init__(f"{field}={shown} is not accepted: {accepted}")


class UnknownName(InvalidRequest):
    """A name (model, hardware, mode, placement) that is not in its table."""

    def __init__(self, field: str, value: object, known: Iterable[str]):
        super().__init__(field, value, "known values are " + ", ".join(sorted(known)))


class HardwareUnavailable(AcceldemoError):
    """The hardware exists in the product but not on this host."""

    field = "hardware"

    def __init__(self, hardware: str, reason: str):
        self.hardware = hardware
        self.reason = reason
        super().__init__(f"hardware {hardware!r} is not available here: {reason}")


class UnsupportedCombination(AcceldemoError):
    """Each value is valid alone but not together (compiled + offload, regional on SD3, ...)."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(message)


class ModelUnavailable(AcceldemoError):
    """A catalog model whose weights are not on this host; never downloaded implicitly."""

    field = "model"


class CapacityExceeded(AcceldemoError):
    """A limit the operator set (shapes per pipeline, waiting time) would be crossed."""


class QueueFull(CapacityExceeded):
    """The engine's line already holds as many waiting requests as the operator allows; nothing was started.

    `ahead`: how many of them wait for the devices this request could use; `retry_after_s`: the engine's estimate of
    when one of those devices is free for it (None until the engine has made one).
    """

    def __init__(self, waiting: int, limit: int, ahead: int = 0, retry_after_s: int | None = None):
        self.waiting, self.limit, self.ahead, self.retry_after_s = waiting, limit, ahead, retry_after_s
        when = f"in about {retry_after_s} s" if retry_after_s is not None else "in a moment"
        super().__init__(f"the queue is full: {waiting} request(s) are already waiting for a device "
                         f"(ACCELDEMO_QUEUE_SIZE={limit}); try again {when}")

    def __reduce__(self):
        return type(self), (self.waiting, self.limit, self.ahead, self.retry_after_s)


class ClientQueueFull(QueueFull):
    """This client already has as many requests waiting as one client may (ACCELDEMO_CLIENT_QUEUE), though the line
    itself may have room: others get their turns; nothing was started."""

    def __init__(self, waiting: int, limit: int, ahead: int = 0, retry_after_s: int | None = None):
        self.waiting, self.limit, self.ahead, self.retry_after_s = waiting, limit, ahead, retry_after_s
        when = f"in about {retry_after_s} s" if retry_after_s is not None else "in a moment"
        CapacityExceeded.__init__(self, f"you already have {waiting} request(s) waiting for a device, as many as "
                                  f"one client may (ACCELDEMO_CLIENT_QUEUE={limit}); try again {when}")


class DeviceBusy(CapacityExceeded):
    """A request waited in line for its devices as long as the operator allows (ACCELDEMO_DEVICE_WAIT_S); nothing
    was started."""


class GpuQuotaExceeded(CapacityExceeded):
    """The platform that lends GPUs per call (ZeroGPU) refused one: the visitor's (or the Space's) GPU quota is spent.
    Nothing was started; `retry_after_s`: when the platform says to try again."""

    def __init__(self, message: str, retry_after_s: int):
        self.retry_after_s = retry_after_s
        super().__init__(message)

    def __reduce__(self):
        return type(self), (str(self), self.retry_after_s)


class Cancelled(AcceldemoError):
    """The person stopped the job; it ended at the next denoise step and freed the device."""


class GenerationFailed(AcceldemoError):
    """The pipeline or compiler failed on a valid request; the message says where."""


class ReplicaLost(GenerationFailed):
    """The process (or pool of processes) holding a replica died or hung: not the request's fault, so the engine
    restarts the replica and may run the request again elsewhere."""

    def __init__(self, devices: str, message: str):
        self.devices = devices
        super().__init__(message)


def describe_error(error: BaseException) -> str:
    """One line a person can read: the compiler's own error rather than dynamo's wrapper around it."""
    inner = getattr(error, "inner_exception", None)
    prefix = "compiling failed: " if inner is not None else ""
    error = inner or error
    text = " ".join(str(error).split())
    text = text.split(" Set TORCHDYNAMO_VERBOSE")[0]
    return f"{prefix}{type(error).__name__}: {text}"[:400]
