"""Step caches applied to one pipeline call, reset for every call and counted: TaylorSeer at the transformer's call
(every mode), diffusers' block hooks in the eager modes. What each cache is and which models offer it: `models.caches`.

The transformer's call seam is `Module._compiled_call_impl`: `Module.__call__` calls it in Python when it is set, and
it is where `Module.compile()` puts the compiled graph, so whatever runs there stays outside every graph — a whole
compiled transformer, compiled blocks, an AOTInductor package (which replaces `forward`), or eager code. TaylorSeer
decides there, before the transformer runs, from the step count alone (so tensor-parallel ranks all skip the same
steps), with diffusers' own `TaylorSeerCacheHook` schedule and `TaylorSeerState` series: a skipped call is answered
with the forecast of the transformer's output and computes nothing. (diffusers' hook cannot sit on the transformer
itself: it would be traced by a whole-transformer compile, and it answers a module returning a 1-tuple with a bare
tensor, which the pipelines index as `[0]`.)
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

from ..models.caches import MAG_FLUX1, TECHNIQUES, CachePreset, StepCache
from ..models.catalog import get_model
from ..records import CacheUse, Request


class CallSeam:
    """Every call of one transformer passes here: it counts them, times the first, and with a forecast (TaylorSeer)
    answers the calls the schedule skips. Installed once per pipeline, after any compile; idle between calls."""

    def __init__(self, transformer):
        self.inner = transformer._compiled_call_impl or transformer._call_impl
        transformer._compiled_call_impl = self
        self.forecast = None
        # A CFG-parallel pool's split of each call over its ranks (`executors.parallel.CfgSplit`); None: whole.
        self.split = None
        self.calls = self.computed = 0
        self.first_call: float | None = None
        self._timestep = None
        self._repeat = 0

    def begin(self, forecast=None) -> None:
        """A new pipeline call: counters at zero, the forecast's series empty."""
        self.forecast = forecast
        self.calls = self.computed = 0
        self.first_call = None
        self._timestep, self._repeat = None, 0

    def __call__(self, *args, **kwargs):
        if self.first_call is None:
            self.first_call = time.perf_counter()
        self.calls += 1
        if self.forecast is None:
            self.computed += 1
            return self._compute(args, kwargs)
        from diffusers.hooks.hooks import CacheContext

        # A step's calls (conditional, then unconditional where guidance calls twice) share its timestep: each keeps
        # a series of its own, as diffusers' per-context state does.
        timestep = kwargs.get("timestep")
        same = timestep is not None and self._timestep is not None and bool((timestep == self._timestep).all())
        self._repeat = self._repeat + 1 if same else 0
        self._timestep = timestep
        self.forecast.state_manager.set_context(CacheContext(f"call-{self._repeat}"))
        compute, state = self.forecast._measure_should_compute()
        if compute:
            self.computed += 1
            output = self._compute(args, kwargs)
            state.update((output,) if _is_tensor(output) else tuple(output))
            return output
        return tuple(state.predict())

    def _compute(self, args: tuple, kwargs: dict):
        return self.split(self.inner, args, kwargs) if self.split is not None else self.inner(*args, **kwargs)


def _is_tensor(value) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


def _taylorseer(preset: CachePreset):
    import torch
    from diffusers.hooks.hooks import StateManager
    from diffusers.hooks.taylorseer_cache import TaylorSeerCacheHook, TaylorSeerState

    params = preset.params
    dtype = getattr(torch, params.get("taylor_factors_dtype", "float32"))
    states = StateManager(TaylorSeerState, init_kwargs={"taylor_factors_dtype": dtype,
                                                         "max_order": params.get("max_order", 1),
                                                         "is_inactive": False})
    return TaylorSeerCacheHook(cache_interval=params["cache_interval"],
                               disable_cache_before_step=params["disable_cache_before_step"],
                               taylor_factors_dtype=dtype, state_manager=states,
                               disable_cache_after_step=params.get("disable_cache_after_step"))


def block_config(preset: CachePreset, pipe, steps: int):
    """diffusers' config of a block cache for one call of `pipe` denoising `steps` steps."""
    import diffusers

    params = dict(preset.params)
    if preset.cache is StepCache.MAG:
        from diffusers.hooks import mag_cache

        if params.get("mag_ratios") == MAG_FLUX1.params["mag_ratios"]:
            params["mag_ratios"] = mag_cache.FLUX_MAG_RATIOS
        params["num_inference_steps"] = steps
    if preset.cache is StepCache.PAB:
        params["current_timestep_callback"] = lambda: pipe.current_timestep
    return getattr(diffusers, TECHNIQUES[preset.cache].config_class)(**params)


def _last_attention_leaf(transformer):
    """A layer that runs only when the transformer's last block computes its attention (block caches skip it)."""
    import torch

    attention = [module for name, module in transformer.named_modules() if name.endswith(".attn")]
    return next(m for m in attention[-1].modules() if isinstance(m, torch.nn.Linear)) if attention else None


@dataclass
class _BlockCount:
    computed: int = 0

    def __call__(self, module, args) -> None:
        self.computed += 1


@contextlib.contextmanager
def step_cache(seam: CallSeam, pipe, called, request: Request) -> Iterator[CacheReport]:
    """The request's step cache on `pipe`'s transformer (whose call seam is `seam`) for one call of `called` (`pipe`,
    or a pipeline made from it for an edit), every state fresh; yields what it did, filled in when the call ends."""
    preset = get_model(request.model).step_caches.get(request.step_cache) if request.step_cache else None
    report = CacheReport(preset, seam)
    block = preset is not None and not preset.cache.decides_per_call
    seam.begin(_taylorseer(preset) if preset is not None and not block else None)
    count, leaf_hook = _BlockCount(), None
    if block:
        pipe.transformer.enable_cache(block_config(preset, called, request.denoise_steps))
        pipe.transformer._reset_stateful_cache()
        leaf = _last_attention_leaf(pipe.transformer)
        leaf_hook = leaf.register_forward_pre_hook(count) if leaf is not None else None
    try:
        yield report
    finally:
        if block:
            if leaf_hook is not None:
                leaf_hook.remove()
            pipe.transformer.disable_cache()
            report.block_computed = count.computed
        report.close()
        seam.begin()


class CacheReport:
    """What one call's step cache did: transformer calls, and those it answered (in full, or for block caches in
    part: the last block's attention not computed)."""

    def __init__(self, preset: CachePreset | None, seam: CallSeam):
        self.preset, self.seam = preset, seam
        self.block_computed: int | None = None
        self.use: CacheUse | None = None
        self.first_call: float | None = None

    def close(self) -> None:
        calls = self.seam.calls
        computed = self.seam.computed if self.block_computed is None else min(self.block_computed, calls)
        self.first_call = self.seam.first_call
        self.use = CacheUse(str(self.preset.cache) if self.preset else None, calls, calls - computed)
