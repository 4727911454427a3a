"""The exact-result cache: a request identical in every value that shapes its image is answered with the images an
earlier one drew (ACCELDEMO_RESULT_CACHE entries, least recently used dropped first)."""
from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict

from ..records import GenerateResult, Request


class ResultCache:
    """Finished results by `Request.image_key`: the prompt, seed, model and every call setting, the hardware, mode,
    placement, quantization and step cache among them (each can change pixels), not the device nor the previews."""

    def __init__(self, entries: int):
        self.entries = entries
        self._kept: OrderedDict[tuple, GenerateResult] = OrderedDict()
        self._lock = threading.Lock()

    def find(self, request: Request, seconds: float) -> GenerateResult | None:
        """The result an identical request had, as this request's (`seconds`: the time it took to find), or None."""
        if not self.entries:
            return None
        with self._lock:
            kept = self._kept.get(request.image_key)
            if kept is None:
                return None
            self._kept.move_to_end(request.image_key)
        return _answered(kept, request, seconds)

    def keep(self, result: GenerateResult) -> None:
        if not self.entries or result.from_cache:
            return
        with self._lock:
            self._kept[result.request.image_key] = result
            self._kept.move_to_end(result.request.image_key)
            while len(self._kept) > self.entries:
                self._kept.popitem(last=False)

    def __len__(self) -> int:
        with self._lock:
            return len(self._kept)


def _answered(kept: GenerateResult, request: Request, seconds: float) -> GenerateResult:
    """`kept` as the answer to `request`: its images (copies: a front end may write on its own), no queue, load or
    compile, `from_cache`."""
    parts = tuple(_answered(part, member, seconds) for part, member in zip(kept.parts, request.members()))
    return dataclasses.replace(kept, request=request, images=[image.copy() for image in kept.images],
                               seconds=seconds, queue_wait=0.0, load_seconds=0.0, compile_seconds=0.0, new_graphs=0,
                               compile_cache_hits=0, warm=True, preview_seconds=0.0, parts=parts, from_cache=True,
                               batch=1, denoise_seconds=None)
