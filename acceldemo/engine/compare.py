"""One prompt and seed drawn under two configurations, one after the other on the engine's line: their times side by
side, the speed ratio, and how far apart the two pictures are."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..errors import InvalidRequest
from ..records import GenerateParams, GenerateResult, Request, placement_label

# The values a comparison may change between its two sides (the prompt, model, seed and size are shared).
SIDE_FIELDS = ("hardware", "mode", "placement", "tp_size", "cp_size", "step_cache", "quantization", "steps")


def second_side(first: Request, second: GenerateParams) -> GenerateParams:
    """The second side's raw request: its own configuration values, the first's prompt, model, seed and size."""
    return dataclasses.replace(second, prompt=first.prompt, model=first.model, seed=first.seed,
                               resolution=first.shape, num_images=1)


def check_pair(first: Request, second: Request) -> None:
    """Two sides that can be compared pixel by pixel: one image each, of one size."""
    if first.num_images != 1 or second.num_images != 1:
        raise InvalidRequest("num_images", max(first.num_images, second.num_images), "1: a comparison draws one image "
                                                                                      "per side")
    if first.shape != second.shape:
        raise InvalidRequest("resolution", str(second.shape), f"{first.shape}, the first side's: the pictures are "
                                                              "compared pixel by pixel")


def configuration(request: Request) -> str:
    """The side's configuration as a person reads it: `cpu · compiled · device · taylorseer · int8 · 28 steps`."""
    where = placement_label(request.placement, request.tp_size, request.cp_size)
    return " · ".join([request.hardware, str(request.mode), where, str(request.step_cache or "no step cache"),
                       f"{request.quantization} weights", f"{request.steps} steps"])


@dataclass(frozen=True)
class Comparison:
    """Both sides' results and the figures between them (the second measured against the first)."""

    first: GenerateResult
    second: GenerateResult

    @property
    def mean_abs_difference(self) -> float:
        """Mean absolute difference of the two pictures' RGB values, in levels of 255."""
        a, b = _pixels(self.first), _pixels(self.second)
        return float(abs(a - b).mean())

    @property
    def psnr(self) -> float:
        """Peak signal-to-noise ratio between the pictures in dB (inf: identical)."""
        a, b = _pixels(self.first), _pixels(self.second)
        mse = float(((a - b) ** 2).mean())
        return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)

    @staticmethod
    def _ratio(a: float | None, b: float | None) -> float | None:
        return None if not a or not b else a / b

    @property
    def speedup(self) -> float | None:
        """How many times faster the second side's call was, in total seconds (first ÷ second)."""
        return self._ratio(_total(self.first), _total(self.second))

    @property
    def denoise_speedup(self) -> float | None:
        """The same for the denoise loop alone (compile excluded)."""
        return self._ratio(self.first.denoise_seconds, self.second.denoise_seconds)

    def sides(self) -> list[dict]:
        return [{"configuration": configuration(r.request), "total_seconds": round(_total(r), 4),
                 "load_seconds": round(r.load_seconds, 4), "compile_seconds": round(r.compile_seconds, 4),
                 "denoise_seconds": None if r.denoise_seconds is None else round(r.denoise_seconds, 4),
                 "new_graphs": r.new_graphs, "step_cache": r.facts()["step_cache"], "weight_bytes": r.weight_bytes,
                 "from_cache": r.from_cache, "device": r.facts()["device"]} for r in (self.first, self.second)]

    def facts(self) -> dict:
        psnr = self.psnr
        return {"prompt": self.first.request.prompt, "model": self.first.request.model, "seed": self.first.request.seed,
                "size": str(self.first.request.shape), "sides": self.sides(),
                "speedup": _rounded(self.speedup), "denoise_speedup": _rounded(self.denoise_speedup),
                "mean_abs_difference": round(self.mean_abs_difference, 3),
                "psnr_db": None if math.isinf(psnr) else round(psnr, 2), "identical": math.isinf(psnr)}


def _total(result: GenerateResult) -> float:
    """A side's own time: its pipeline call with its load, not its wait in line (the first side's call may be what
    the second waited for)."""
    return result.seconds - result.queue_wait


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _pixels(result: GenerateResult):
    import numpy as np

    return np.asarray(result.image.convert("RGB"), dtype=np.float64)
