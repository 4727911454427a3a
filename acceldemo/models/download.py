"""Fetching a real model from the Hugging Face Hub when the operator allows it (ACCELDEMO_DOWNLOAD, `--download`):
only the files its pipeline loads, into the Hugging Face cache, resumable, after a disk-space check, with progress in
bytes; a gated repository without access and a missing one are refused by name. huggingface_hub does the transfer
(`snapshot_download`, which reads HF_TOKEN and HF_ENDPOINT itself)."""
from __future__ import annotations

import json
import logging
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..config import Settings
from ..errors import ModelUnavailable
from .catalog import ModelSpec
from .loading import model_dir_folder, model_is_here

log = logging.getLogger("acceldemo.download")
# Other formats of the same weights that repositories carry beside diffusers' safetensors: never fetched.
IGNORED = ["*.bin", "*.pt", "*.pth", "*.ckpt", "*.msgpack", "*.h5", "*.onnx", "*.onnx_data", "*.gguf"]
# Room kept free beyond the files themselves (the cache's metadata, a file being written).
DISK_MARGIN = 1.05
# A part-file not written to for this long is no transfer in progress.
ORPHAN_AGE_S = 60.0
# Progress is reported at most this often (bytes arrive in 10 MB chunks, many per second).
REPORT_EVERY_S = 0.5


@dataclass
class Fetch:
    """One model being fetched: bytes done of the total, as the transfer reports them."""

    model: str
    repo: str
    total: int
    done: int = 0
    files: int = 0

    def describe(self) -> str:
        return f"downloading {self.repo}: {self.done / 1e9:.2f} of {self.total / 1e9:.2f} GB ({self.files} files)"


class Downloads:
    """The fetches of one engine: at most one per model at a time (a second request for it waits for the first),
    each visible while it runs (`active`)."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self._lock = threading.Lock()
        self._per_model: dict[str, threading.Lock] = {}
        self._active: dict[str, Fetch] = {}

    def active(self) -> list[dict]:
        with self._lock:
            return [{"model": f.model, "repo": f.repo, "done_bytes": f.done, "total_bytes": f.total,
                     "files": f.files} for f in self._active.values()]

    def ensure(self, spec: ModelSpec, on_progress: Callable[[Fetch], None]) -> None:
        """The model's files on this host when downloads are allowed: those of a fetch that completed here before,
        or fetched now — the missing files only, resuming a file cut short (else nothing: loading then says where it
        looked). A folder under ACCELDEMO_MODEL_DIR is the operator's and used as it is."""
        if spec.repo is None or not self.settings.download or model_dir_folder(spec, self.settings) \
                or self._complete(spec).is_file():
            return
        with self._lock:
            serial = self._per_model.setdefault(spec.name, threading.Lock())
        with serial:
            if not self._complete(spec).is_file():
                self._fetch(spec, on_progress)

    @staticmethod
    def _complete(spec: ModelSpec) -> Path:
        """The mark a completed fetch leaves in the repository's folder of the Hugging Face cache (a model_index.json
        there alone says nothing of the files beside it); it goes when that folder goes."""
        from huggingface_hub import constants

        return Path(constants.HF_HUB_CACHE) / f"models--{spec.repo.replace('/', '--')}" / "acceldemo-complete.json"

    def _fetch(self, spec: ModelSpec, on_progress: Callable[[Fetch], None]) -> None:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import DryRunError

        patterns = needed_files(spec)
        try:
            planned = snapshot_download(spec.repo, allow_patterns=patterns, ignore_patterns=IGNORED, dry_run=True)
        except DryRunError as error:  # the Hub cannot be reached: a copy already here serves
            if model_is_here(spec, self.settings):
                log.warning("%s: the Hub cannot be reached (%s); loading the copy in the cache", spec.repo, error)
                return
            raise ModelUnavailable(f"model {spec.name!r} ({spec.repo}) cannot be fetched from {constants.ENDPOINT}: "
                                   f"{error}") from None
        total = sum(f.file_size or 0 for f in planned)
        missing = sum(f.file_size or 0 for f in planned if f.will_download)
        cache = constants.HF_HUB_CACHE
        free = shutil.disk_usage(_existing_parent(cache)).free
        if missing * DISK_MARGIN > free:
            raise ModelUnavailable(f"model {spec.name!r} ({spec.repo}) needs {missing / 1e9:.2f} GB more in the "
                                   f"Hugging Face cache ({cache}), which has {free / 1e9:.2f} GB free: free some space "
                                   "or point HF_HOME at a larger disk")
        _remove_orphans(Path(cache) / f"models--{spec.repo.replace('/', '--')}")
        fetch = Fetch(spec.name, spec.repo, total, total - missing, len(planned))
        with self._lock:
            self._active[spec.name] = fetch
        log.info("%s", fetch.describe())
        on_progress(fetch)
        try:
            snapshot_download(spec.repo, allow_patterns=patterns, ignore_patterns=IGNORED,
                              tqdm_class=_progress_class(fetch, on_progress))
        except Exception as error:  # noqa: BLE001 - said as the engine's error, with what was fetched
            raise ModelUnavailable(f"downloading {spec.repo} stopped at {fetch.done / 1e9:.2f} of "
                                   f"{total / 1e9:.2f} GB ({type(error).__name__}: {str(error)[:300]}); a retry "
                                   "resumes where it stopped") from None
        finally:
            with self._lock:
                self._active.pop(spec.name, None)
        fetch.done = total
        on_progress(fetch)
        mark = self._complete(spec)
        mark.parent.mkdir(parents=True, exist_ok=True)
        mark.write_text(json.dumps({"repo": spec.repo, "bytes": total, "files": len(planned),
                                    "commit": planned[0].commit_hash if planned else None}))


def needed_files(spec: ModelSpec) -> list[str]:
    """The repository's files its pipeline loads: model_index.json and the folder of each component it names (the
    original single-file checkpoints beside them are left on the Hub). A gated or missing repository is refused here,
    naming what to do."""
    from huggingface_hub import hf_hub_download

    index = _answered(spec, lambda: hf_hub_download(spec.repo, "model_index.json"))
    with open(index) as file:
        components = [name for name, entry in json.load(file).items()
                      if isinstance(entry, list) and len(entry) == 2 and entry[0]]
    return ["model_index.json", *(f"{name}/*" for name in components)]


def _answered(spec: ModelSpec, ask: Callable[[], str]) -> str:
    """`ask()`'s answer, or the Hub's refusal as a message that says what to do."""
    from huggingface_hub import constants, get_token
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    page = f"{constants.ENDPOINT}/{spec.repo}"
    try:
        return ask()
    except GatedRepoError:
        if get_token() is None:
            raise ModelUnavailable(f"model {spec.name!r} ({spec.repo}) is gated: accept its terms at {page} with a "
                                   "Hugging Face account and set HF_TOKEN to that account's token") from None
        raise ModelUnavailable(f"model {spec.name!r} ({spec.repo}) is gated and the token in HF_TOKEN has no access "
                               f"to it: accept its terms at {page} with that token's account") from None
    except RepositoryNotFoundError:
        raise ModelUnavailable(f"model {spec.name!r}: there is no repository {spec.repo} at {constants.ENDPOINT} "
                               "(or it is private to another account)") from None
    except HfHubHTTPError as error:
        raise ModelUnavailable(f"model {spec.name!r} ({spec.repo}) cannot be fetched from {constants.ENDPOINT}: "
                               f"{str(error).splitlines()[0]}") from None


def _remove_orphans(folder: Path) -> None:
    """Part-files a fetch killed before it finished left in the repository's cache folder: huggingface_hub 2.4 writes
    each transfer to a file of its own and never reuses one, so they only take disk. A file written to in the last
    minute may be another process's transfer in progress and is left alone."""
    now = time.time()
    for part in folder.glob("blobs/*.incomplete"):
        try:
            if now - part.stat().st_mtime > ORPHAN_AGE_S:
                part.unlink()
                log.info("removed %s, left by a fetch that did not finish", part.name)
        except FileNotFoundError:
            pass


def _existing_parent(path: str) -> str:
    folder = Path(path)
    while not folder.exists():
        folder = folder.parent
    return str(folder)


def _progress_class(fetch: Fetch, on_progress: Callable[[Fetch], None]) -> type:
    """A silent tqdm for snapshot_download's progress bars: its byte bar ("Reconstructing": bytes written to the
    cache, resumed bytes included) moves `fetch` along from what was cached before; the others only run."""
    from tqdm.auto import tqdm

    cached = fetch.done

    class Progress(tqdm):
        def __init__(self, *args, **kwargs):
            self.counts_bytes = kwargs.get("unit") == "B" and str(kwargs.get("desc", "")).startswith("Reconstruct")
            self._reported = 0.0
            super().__init__(*args, **{**kwargs, "disable": True})

        def update(self, n=1):
            self.n += n or 0
            if self.counts_bytes:
                fetch.done = min(cached + int(self.n), fetch.total)
                now = time.monotonic()
                if now - self._reported >= REPORT_EVERY_S:
                    self._reported = now
                    on_progress(fetch)

    return Progress
