"""The images /v1 answers as URLs, kept for an hour in a private folder of this app."""
from __future__ import annotations

import secrets
import shutil
import tempfile
import threading
import time
from pathlib import Path

# How long an image answered as a URL is served.
IMAGE_TTL_S = 3600


class ImageStore:
    """The images answered as URLs: files in a private (0700) folder of this app, each served for `ttl_s` seconds
    under a random 128-bit id; expired ones are deleted as the store is used, the folder when the app ends."""

    def __init__(self, ttl_s: float = IMAGE_TTL_S, parent: str | None = None):
        self.ttl_s = ttl_s
        self.folder = Path(tempfile.mkdtemp(prefix="v1-images-", dir=parent))
        # id -> (expiry, format), in the order they were added, so also the order they expire
        self._kept: dict[str, tuple[float, str]] = {}
        self._lock = threading.Lock()

    def put(self, data: bytes, output_format: str = "png") -> str:
        key = secrets.token_urlsafe(16)
        (self.folder / f"{key}.{output_format}").write_bytes(data)
        with self._lock:
            self._purge()
            self._kept[key] = (time.monotonic() + self.ttl_s, output_format)
        return key

    def get(self, key: str) -> bytes | None:
        """The image's bytes while it is served; None for an unknown or expired id."""
        found = self.find(key)
        return found[0] if found else None

    def find(self, key: str) -> tuple[bytes, str] | None:
        """The image's bytes and format while it is served; None for an unknown or expired id."""
        with self._lock:
            self._purge()
            if key not in self._kept:
                return None
            output_format = self._kept[key][1]
        try:
            return (self.folder / f"{key}.{output_format}").read_bytes(), output_format
        except FileNotFoundError:  # expired and deleted by another request in between
            return None

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)

    def _purge(self) -> None:
        now = time.monotonic()
        while self._kept:
            key, (expiry, output_format) = next(iter(self._kept.items()))
            if expiry > now:
                return
            del self._kept[key]
            (self.folder / f"{key}.{output_format}").unlink(missing_ok=True)
