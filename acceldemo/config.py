"""Operator settings from the environment, and the process environment set before torch loads."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("acceldemo")


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def _env_choice(name: str, default: str, accepted: tuple[str, ...]) -> str:
    value = os.environ.get(name, default)
    if value not in accepted:
        raise ValueError(f"{name}={value!r}: accepted values are {', '.join(accepted)}")
    return value


@dataclass(frozen=True)
class Settings:
    """What an operator can set; every field has an ACCELDEMO_* variable."""

    cache_dir: Path
    max_resident_pipelines: int
    max_shapes_per_pipeline: int
    model_dir: Path | None
    # "auto": mode compiled on CPU/CUDA builds AOTInductor packages per shape and reuses them after restarts;
    # "off": plain torch.compile with inductor's own caches.
    precompile: str = "auto"
    # Longest wait for a busy device before a request is answered "busy, retry".
    device_wait_s: float = 600.0
    # Requests the Gradio queue holds waiting; one more is refused at once with "queue is full".
    queue_size: int = 64
    # Longest one worker-pool command (start, load, request) may take before the pool counts as hung and is stopped.
    pool_timeout_s: float = 1800.0
    # How long /ready waits for the start-up warm-up before the app serves anyway (the warm-up itself goes on).
    warmup_timeout_s: float = 1800.0

    @staticmethod
    def from_env() -> "Settings":
        default_cache = Path("/data/acceldemo") if Path("/data").is_dir() and os.access("/data", os.W_OK) \
            else Path.home() / ".cache" / "acceldemo"
        model_dir = os.environ.get("ACCELDEMO_MODEL_DIR")
        return Settings(
            cache_dir=Path(os.environ.get("ACCELDEMO_CACHE_DIR", default_cache)),
            max_resident_pipelines=_env_int("ACCELDEMO_MAX_RESIDENT", 3),
            max_shapes_per_pipeline=_env_int("ACCELDEMO_MAX_SHAPES", 32),
            model_dir=Path(model_dir) if model_dir else None,
            precompile=_env_choice("ACCELDEMO_PRECOMPILE", "auto", ("auto", "off")),
            device_wait_s=float(os.environ.get("ACCELDEMO_DEVICE_WAIT_S", 600)),
            queue_size=_env_int("ACCELDEMO_QUEUE_SIZE", 64),
            pool_timeout_s=float(os.environ.get("ACCELDEMO_POOL_TIMEOUT_S", 1800)),
            warmup_timeout_s=float(os.environ.get("ACCELDEMO_WARMUP_TIMEOUT_S", 1800)),
        )


def apply_environment(settings: Settings) -> None:
    """Point every compiler cache at the app cache dir and keep a broken backend from aborting torch.

    Must run before the first `import torch`: torch_neuronx reads its NEFF cache dir when autoloaded.
    An operator's own setting of any variable wins.
    """
    from .hardware import HARDWARE
    from .hardware.tpu import tpu_autoload_would_abort

    for hardware in HARDWARE.values():
        for variable, folder in hardware.cache_env.items():
            os.environ.setdefault(variable, str(settings.cache_dir / folder))
    if tpu_autoload_would_abort():
        os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
        log.warning("torch_tpu is installed without libtpu: backend autoload turned off so torch can load")
