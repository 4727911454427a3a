"""One reply protocol for a command run elsewhere whose answer streams back: a worker pool's rank 0 answering the
app over its socket, and a fleet replica answering over Ray Serve's stream. Progress events as they come, then one
end: the value, the command's own error, or (a pool only) the process group broken."""
from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass

from ..records import Progress


@dataclass(frozen=True)
class Reported:
    """A progress event of the command in flight."""

    event: Progress


@dataclass(frozen=True)
class Done:
    """The command's value (a pool's load or status reports, a replica's result)."""

    value: object = None


@dataclass(frozen=True)
class Failed:
    """The command failed (its exception, as `portable_error` left it); whoever ran it serves on."""

    error: BaseException


@dataclass(frozen=True)
class Broken:
    """A pool's process group itself failed: the ranks leave."""

    why: str


Reply = Reported | Done | Failed | Broken


def portable_error(error: BaseException, fallback: Callable[[str], BaseException] | None = None) -> BaseException:
    """The exception itself where it survives pickling with its type and words (so the receiver sees the same type,
    e.g. an out-of-memory one, or the engine's typed refusal); else its words in `fallback`, by default a
    RuntimeError naming its type."""
    try:
        copy = pickle.loads(pickle.dumps(error))
        if type(copy) is type(error) and str(copy) == str(error):
            return error
    except Exception:  # an error type whose constructor takes other arguments than its message
        pass
    return fallback(str(error)) if fallback else RuntimeError(f"{type(error).__name__}: {error}")
