"""LoRA styles that switch without recompiling: one adapter slot per pipeline, made the way diffusers hot-swaps.

Before the first compile, `enable_lora_hotswap(target_rank=R)` and a first adapter that covers every layer any of
the model's styles changes, with all-zero weights, at rank R, the largest of them. A call then swaps its style's
weights into that slot in place (`load_lora_weights(..., hotswap=True)`) and sets its strength by writing the slot's
up weights in place (the style's own weights × alpha/rank × strength), the slot's scaling staying 1: the compiled
transformer sees the same modules, shapes and values it was traced with, so it compiles nothing. Not
`set_adapters`: it puts a Python float into the scaling, which dynamo guards on (a new graph per strength), and an
AOTInductor package bakes the scaling in as a constant. No style is strength 0 (diffusers' hot-swap skips an
all-zero state dict). A precompiled package runs on the live module's tensors (no weights inside), so the same slot
switches styles there too: one package serves every style.
"""
from __future__ import annotations

import logging

from ..config import Settings
from ..errors import InvalidRequest
from ..models.catalog import ModelSpec
from ..models.loras import LoraStyle, lora_state_dict, model_loras

log = logging.getLogger("acceldemo.styles")

SLOT = "style"


def _modules(pipe, target: str):
    component, _, path = target.partition(".")
    return getattr(pipe, component).get_submodule(path)


class StyleSlot:
    """The pipeline's one LoRA slot: which style it holds, at which strength."""

    def __init__(self, pipe, spec: ModelSpec, settings: Settings, styles: dict[str, LoraStyle]):
        import torch

        self.spec, self.settings = spec, settings
        self.rank = max(style.rank for style in styles.values())
        self.targets = frozenset().union(*(style.targets for style in styles.values()))
        self.zero = {}
        for target in sorted(self.targets):
            layer = _modules(pipe, target)
            self.zero[f"{target}.lora_A.weight"] = torch.zeros(self.rank, layer.in_features)
            self.zero[f"{target}.lora_B.weight"] = torch.zeros(layer.out_features, self.rank)
        pipe.enable_lora_hotswap(target_rank=self.rank)
        pipe.load_lora_weights(self.zero, adapter_name=SLOT)
        components = [c for c in pipe.components.values() if isinstance(c, torch.nn.Module)]
        self.layers = [m for c in components for m in c.modules() if isinstance(getattr(m, "scaling", None), dict)
                       and SLOT in m.scaling]
        self.held: str | None = None
        self.scale: float | None = 1.0
        self._states: dict[tuple, dict] = {}
        self._full = [layer.lora_B[SLOT].weight.detach().clone() for layer in self.layers]
        log.info("%s: LoRA slot of rank %d over %d layers, for %s", spec.name, self.rank, len(self.targets),
                 ", ".join(sorted(styles)))

    def _state(self, style: LoraStyle) -> dict:
        """The style's weights, converted once and kept (a style is small; reading and converting its file on every
        switch costs more than the swap)."""
        key = (style.path, style.path.stat().st_mtime_ns)
        if key not in self._states:
            self._states[key] = lora_state_dict(self.spec, style.path)
        return self._states[key]

    def refusal(self, style: LoraStyle) -> str | None:
        """Why this style cannot go into the slot without recompiling (it was added after the slot was made)."""
        if style.rank > self.rank:
            return (f"its rank {style.rank} exceeds the rank {self.rank} the compiled pipeline's LoRA slot was made "
                    "with; restart the app (or drop the pipeline) to offer it")
        extra = style.targets - self.targets
        if extra:
            return (f"it changes {len(extra)} layer(s) the other styles do not (e.g. {sorted(extra)[0]}); restart "
                    "the app (or drop the pipeline) to offer it")
        return None

    def use(self, pipe, name: str | None, scale: float) -> None:
        """Hold the style called `name` at `scale`, or no style (None: whatever it holds, at strength 0); nothing
        happens when it already does."""
        import torch

        if name is None:
            scale = 0.0
        elif name != self.held:
            style = model_loras(self.spec, self.settings).get(name)
            if style is None:
                raise InvalidRequest("lora", name, f"a style {self.spec.name} offers (its file is gone)")
            if reason := self.refusal(style):
                raise InvalidRequest("lora", style.name, f"a style the loaded pipeline can switch to: {reason}")
            pipe.load_lora_weights(dict(self._state(style)), adapter_name=SLOT, hotswap=True)
            # The style's alpha/rank goes into its up weights; the slot's scaling stays 1 (see the module's note).
            self._full = []
            for layer in self.layers:
                self._full.append(layer.lora_B[SLOT].weight.detach() * float(layer.scaling[SLOT]))
                if torch.is_tensor(layer.scaling[SLOT]):
                    layer.scaling[SLOT].fill_(1.0)
                else:
                    layer.scaling[SLOT] = 1.0
            self.held, self.scale = name, None
        if scale == self.scale:
            return
        with torch.no_grad():
            for layer, full in zip(self.layers, self._full):
                layer.lora_B[SLOT].weight.copy_(full * scale)
        self.scale = scale
        precompiled = pipe.transformer.forward
        if hasattr(precompiled, "weights_changed"):  # AOTInductor packages may fold weights at load
            precompiled.weights_changed()


def prepare_styles(pipe, spec: ModelSpec, settings: Settings) -> StyleSlot | None:
    """The pipeline's LoRA slot when the model offers styles (made before any compile), else None."""
    styles = model_loras(spec, settings)
    return StyleSlot(pipe, spec, settings, styles) if styles else None


def use_style(slot: StyleSlot | None, pipe, spec: ModelSpec, name: str | None, scale: float) -> None:
    """Put the request's style into the pipeline's slot (None: it has none) before its call."""
    if slot is None:
        if name is not None:
            raise InvalidRequest("lora", name, f"a style offered when the pipeline was loaded: {spec.name} had "
                                               "none then; restart the app (or drop the pipeline)")
        return
    slot.use(pipe, name, scale)
