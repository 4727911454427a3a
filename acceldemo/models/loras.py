"""LoRA styles a model offers: the ones it ships with and the operator's
(ACCELDEMO_LORA_DIR/<model>/<name>.safetensors), each read once for what hot-swapping needs (its rank and the layers
it changes), never for more."""
from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass
from pathlib import Path

from ..config import Settings
from .catalog import ModelSpec

log = logging.getLogger("acceldemo.loras")

# A style's name is its file's name without .safetensors.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
# "lora_A"/"lora_down" hold the rank as their first dimension, in every format diffusers converts to its own.
_DOWN = (".lora_A.weight", ".lora_A.default.weight")


@dataclass(frozen=True)
class LoraStyle:
    """One LoRA file: its name, where it is, its rank and the layers it changes (diffusers' names, prefixed by the
    pipeline component: `transformer.transformer_blocks.0.attn.to_q`)."""

    name: str
    path: Path
    rank: int
    targets: frozenset[str]
    bytes: int

    def describe(self) -> dict:
        return {"name": self.name, "rank": self.rank, "layers": len(self.targets), "bytes": self.bytes}


_READ: dict[tuple, LoraStyle | None] = {}
_READING = threading.Lock()


def shipped_folder(spec: ModelSpec) -> Path | None:
    """The styles a bundled model ships with."""
    if spec.bundled:
        from .shapes import trained_model_dir

        return trained_model_dir().parent / "loras"
    return None


def lora_state_dict(spec: ModelSpec, path: Path) -> dict:
    """The file's weights in diffusers' own key format (the pipeline class's loader converts other formats)."""

    state = spec.family.pipeline_class().lora_state_dict(str(path))
    return state[0] if isinstance(state, tuple) else state


def read_style(spec: ModelSpec, path: Path) -> LoraStyle | None:
    """The style in `path`, or None (logged) when diffusers cannot read it as a LoRA for this model."""
    stat = path.stat()
    key = (spec.name, str(path), stat.st_mtime_ns, stat.st_size)
    with _READING:
        if key in _READ:
            return _READ[key]
        try:
            state = lora_state_dict(spec, path)
            ranks = {tensor.shape[0] for name, tensor in state.items() if name.endswith(_DOWN)}
            targets = frozenset(name[:-len(end)] for name in state for end in _DOWN if name.endswith(end))
            if not targets:
                raise ValueError("no lora_A weights after conversion")
            style = LoraStyle(path.stem, path, max(ranks), targets, stat.st_size)
        except Exception as error:  # a file diffusers cannot read is left out, with the reason in the log
            log.warning("LoRA %s is left out for %s: %s: %s", path, spec.name, type(error).__name__, error)
            style = None
        _READ[key] = style
        return style


def model_loras(spec: ModelSpec, settings: Settings) -> dict[str, LoraStyle]:
    """Every style this model offers, by name: its own, then the operator's folder's (which win on a clash)."""
    folders = [shipped_folder(spec)]
    if settings.lora_dir is not None:
        folders.append(settings.lora_dir / spec.name)
    styles: dict[str, LoraStyle] = {}
    for folder in folders:
        if folder is None or not folder.is_dir():
            continue
        for path in sorted(folder.glob("*.safetensors")):
            if _NAME.match(path.stem) and path.stem != "none":
                style = read_style(spec, path)
                if style is not None:
                    styles[style.name] = style
    return styles
