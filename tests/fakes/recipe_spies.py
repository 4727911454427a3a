"""Spies on the calls a recipe makes into diffusers and torch: each records its arguments and calls through."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch
from diffusers import DiffusionPipeline, ModelMixin


def _wrap(owner: type, name: str, record: Callable[..., None], after: bool = False) -> None:
    original = getattr(owner, name)

    @functools.wraps(original)
    def spy(self, *args, **kwargs):
        # The module that made the call: the app's own calls come from acceldemo.*, the rest from
        # diffusers re-arming offload or compiling the blocks it was asked to.
        caller = sys._getframe(1).f_globals.get("__name__", "?")
        if not after:
            record(caller, self, *args, **kwargs)
        out = original(self, *args, **kwargs)
        if after:
            record(caller, self, *args, **kwargs)
        return out

    setattr(owner, name, spy)


def _device_type(value: Any) -> str | None:
    return value.device.type if isinstance(value, torch.Tensor) else None


def spy_on_recipe_calls(transformer_classes: tuple[type, ...],
                        eager_mode: Callable[[], str | None] = lambda: None) -> dict[str, list]:
    """Record, as JSON-able values, every placement and compile call and every transformer call.

    Keys: "pipeline_to" (arguments of DiffusionPipeline.to), "offload" (arguments of
    enable_model_cpu_offload and the device it chose), "compile" (class and arguments of each
    nn.Module.compile, blocks included), "compile_repeated_blocks" (class and arguments), each
    with "caller", the module that made the call; and "transformer_calls" (device of the
    weights and of hidden_states, and `eager_mode()`, at each call of a transformer of
    `transformer_classes`).
    """
    calls: dict[str, list] = {key: [] for key in (
        "pipeline_to", "offload", "compile", "compile_repeated_blocks", "transformer_calls")}

    _wrap(DiffusionPipeline, "to", lambda caller, self, *a, **k: calls["pipeline_to"].append(
        {"caller": caller, "args": [str(x) for x in a], "kwargs": {n: str(v) for n, v in k.items()}}))
    _wrap(DiffusionPipeline, "enable_model_cpu_offload", lambda caller, self, *a, **k: calls["offload"].append(
        {"caller": caller, "args": [str(x) for x in a], "kwargs": {n: str(v) for n, v in k.items()},
         "device": str(self._offload_device)}),
        after=True)
    _wrap(torch.nn.Module, "compile", lambda caller, self, *a, **k: calls["compile"].append(
        {"caller": caller, "module": type(self).__name__, "args": list(a), "kwargs": k}))
    _wrap(ModelMixin, "compile_repeated_blocks", lambda caller, self, *a, **k: calls["compile_repeated_blocks"]
          .append({"caller": caller, "module": type(self).__name__, "args": list(a), "kwargs": k}))

    # Wrapping __call__, not forward, keeps the spy outside what torch.compile traces.
    def record_transformer_call(caller, self, *args, **kwargs):
        calls["transformer_calls"].append({
            "module": type(self).__name__,
            "weights": next(self.parameters()).device.type,
            "hidden_states": _device_type(kwargs.get("hidden_states", args[0] if args else None)),
            "eager_mode": eager_mode(),
        })

    for cls in transformer_classes:
        _wrap(cls, "__call__", record_transformer_call)
    return calls
