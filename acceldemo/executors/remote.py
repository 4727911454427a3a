"""The shared artifact store: a second tier behind the local cache folder, on any fsspec URL (a shared folder,
s3://, gs://, hf://), each artifact published with a checksummed manifest, written last.

Layout under the URL, for an artifact called NAME (e.g. `aoti/tiny-shapes/cpu/<key digest>`):
  NAME.<sha256[:16]><suffix>   the artifact's bytes, named by their checksum, so two hosts publishing one NAME at once
                               never write the same object with different bytes;
  NAME.manifest.json           {"name", "sha256", "bytes", "object", "about", ...}: what a reader verifies before it
                               loads; signed by the publisher's key when it has one (`signing`: "signature",
                               "signed_by"), and with a trust file set nothing unsigned or signed by another key loads.
A reader takes the manifest first and refuses what does not match it; the manifest is written only once its object
is complete, so an object without a manifest is an upload cut short (or still in flight) and is refused too.

A store that cannot be reached (network down, credentials refused) never fails a request: the operation answers
"unavailable", the outage is logged once and kept for /status, and the store is left alone for `RETRY_AFTER_S`.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from ..config import store_url
from .signing import SIGNING_KEY_SETTING, TRUST_SETTING, SignatureState, Signer, Trust, check

log = logging.getLogger("acceldemo.artifacts")

MANIFEST = ".manifest.json"
# After a failure, store operations are skipped (the host compiles itself) this long before the store is tried again.
RETRY_AFTER_S = 60.0
# Packages for the store's protocols that are not installed with the app (fsspec itself comes with huggingface_hub).
_EXTRAS = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs"}
STORE_EVENTS = ("fetched", "published", "store_failed")
# Said at start-up and shown in /status while a remote store is read without a trust file.
NO_TRUST = ("ACCELDEMO_ARTIFACTS_TRUST is not set: packages from the shared store (native code) are loaded on a "
            "checksum kept in the same store, so whoever can write the store can run code on this host; see "
            "docs/fleet.md, Signed packages")


class FetchOutcome(StrEnum):
    """What a read of the store found: a verified artifact (hit), nothing (miss), something refused (a checksum
    mismatch, a manifest without its object or an object without its manifest), or no answer (unavailable)."""

    HIT = "hit"
    MISS = "miss"
    REJECTED = "rejected"
    UNAVAILABLE = "unavailable"


class Refusal(StrEnum):
    """Why a fetched artifact was refused: its bytes differ from its manifest (checksum), a publication is cut short
    (incomplete), or, with a trust file set, its manifest is unsigned, badly signed or signed by an unlisted key."""

    CHECKSUM = "checksum"
    INCOMPLETE = "incomplete"
    UNSIGNED = SignatureState.UNSIGNED.value
    BAD_SIGNATURE = SignatureState.BAD_SIGNATURE.value
    UNTRUSTED_KEY = SignatureState.UNTRUSTED_KEY.value


@dataclass(frozen=True)
class Fetched:
    outcome: FetchOutcome
    about: dict | None = None
    why: str = ""
    reason: Refusal | None = None


def shown_url(url: str) -> str:
    """The URL without any user:password part, for logs and views."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _describe(error: BaseException) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {text[:300]}" if text else type(error).__name__


class RemoteArtifacts:
    """One store URL, reached through fsspec (s3fs, gcsfs, huggingface_hub's HfFileSystem, a local folder), with
    what this process has seen of it: counts of fetches and publications, and the current outage if any."""

    _shared: dict[str, RemoteArtifacts] = {}
    _shared_lock = threading.Lock()

    def __init__(self, url: str, options: dict | None = None, signer: Signer | None = None,
                 trust: Trust | None = None):
        self.url = store_url(url) or ""
        self.options = dict(options or {})
        # Signs what this process publishes; None: its manifests go unsigned. Checks what it fetches; None: any
        # signature or none (the start-up warning and /status say so).
        self.signer, self.trust = signer, trust
        self.events: Counter = Counter()
        self.problem: str | None = None
        self.problem_since: float | None = None
        self._failed_at = 0.0
        self._fs = None
        self._root = ""
        self._lock = threading.Lock()

    @classmethod
    def shared(cls, url: str, options: dict | None = None, signer: Signer | None = None,
               trust: Trust | None = None) -> RemoteArtifacts:
        """The process's one client of a store (the engine and its in-process executor see the same outage)."""
        key = json.dumps([url, options or {}, signer and signer.key_id, trust and trust.key_ids], sort_keys=True,
                         default=str)
        with cls._shared_lock:
            if key not in cls._shared:
                cls._shared[key] = cls(url, options, signer, trust)
            return cls._shared[key]

    # --- reaching the store -----------------------------------------------------------------------------------------

    def filesystem(self):
        """The fsspec filesystem and the root path in it; a missing client package is named with what to install."""
        with self._lock:
            if self._fs is None:
                import fsspec.core

                scheme = urlsplit(self.url).scheme if "://" in self.url else "file"
                try:
                    self._fs, self._root = fsspec.core.url_to_fs(self.url, **self.options)
                except ImportError as error:
                    package = _EXTRAS.get(scheme, f"the fsspec implementation of {scheme}://")
                    listed = " (listed in requirements-fleet.txt)" if package == "s3fs" else ""
                    raise ImportError(f"the artifact store {shown_url(self.url)} needs {package}: pip install "
                                      f"{package}{listed} ({error})") from None
                self._root = self._root.rstrip("/")
            return self._fs, self._root

    def _path(self, name: str) -> str:
        return f"{self.filesystem()[1]}/{name}"

    def available(self) -> bool:
        """False while a recent failure says the store is down (it is tried again after RETRY_AFTER_S)."""
        return self.problem is None or time.monotonic() - self._failed_at >= RETRY_AFTER_S

    def failed(self, error: BaseException | str, doing: str) -> None:
        """Keep an outage for the views; log it when it starts (once), not at every operation it fails."""
        self.events["store_failed"] += 1
        self._mark(error if isinstance(error, str) else _describe(error), doing)

    def _mark(self, what: str, doing: str) -> None:
        self._failed_at = time.monotonic()
        if self.problem is None:
            self.problem_since = time.time()
            log.warning("artifact store %s cannot be used (%s while %s): compiling locally and serving on; it is "
                        "tried again after %.0f s", shown_url(self.url), what, doing, RETRY_AFTER_S)
        self.problem = what

    def reached(self) -> None:
        if self.problem is not None:
            log.info("artifact store %s is reachable again", shown_url(self.url))
        self.problem, self.problem_since = None, None

    def note(self, problem: str | None) -> None:
        """What another process (a replica, a pool rank) saw of this store in its last operation."""
        if problem:
            self._mark(problem, "used by a worker process")
        else:
            self.reached()

    def check(self) -> bool:
        """Ask the store once (a listing of its root): at start, so an outage shows before the first compile."""
        try:
            fs, root = self.filesystem()
            fs.invalidate_cache(root)
            fs.ls(root, detail=False)
        except FileNotFoundError:  # nothing published yet: the first publication makes it
            pass
        except Exception as error:
            self.failed(error, "listing the store")
            return False
        self.reached()
        return True

    # --- one artifact -----------------------------------------------------------------------------------------------

    def fetch(self, name: str, target: Path) -> Fetched:
        """The artifact NAME written to `target` once its bytes match its manifest's checksum; or why not."""
        if not self.available():
            return Fetched(FetchOutcome.UNAVAILABLE, why=self.problem or "")
        try:
            fs, _ = self.filesystem()
            try:
                manifest = json.loads(fs.cat_file(self._path(name + MANIFEST)))
            except FileNotFoundError:
                if self._objects_of(name):
                    return self._refused(name, Refusal.INCOMPLETE, "an object without its manifest (an upload cut "
                                                                   "short, or in flight)")
                self.reached()
                return Fetched(FetchOutcome.MISS)
            except ValueError:
                return self._refused(name, Refusal.INCOMPLETE, "a manifest that is not JSON (cut short)")
            if not isinstance(manifest, dict) or not {"object", "sha256", "bytes"} <= set(manifest):
                return self._refused(name, Refusal.INCOMPLETE, "a manifest without object, sha256 and bytes")
            if self.trust is not None:  # before any byte of the object is downloaded
                verdict = check(name, manifest, self.trust)
                if verdict.state is not SignatureState.TRUSTED:
                    return self._refused(name, Refusal(verdict.state), verdict.why)
            partial = target.with_name(f".fetch-{os.getpid()}-{threading.get_ident()}-{target.name}")
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                try:
                    fs.get_file(self._path(manifest["object"]), str(partial))
                except FileNotFoundError:
                    return self._refused(name, Refusal.INCOMPLETE,
                                         f"a manifest whose object {manifest['object']} is missing")
                size, digest = partial.stat().st_size, sha256_of(partial)
                if (size, digest) != (manifest["bytes"], manifest["sha256"]):
                    return self._refused(name, Refusal.CHECKSUM,
                                         f"{manifest['object']}: {size} bytes with sha256 {digest[:16]}…, its "
                                         f"manifest says {manifest['bytes']} bytes, {manifest['sha256'][:16]}…")
                os.replace(partial, target)
            finally:
                partial.unlink(missing_ok=True)
        except Exception as error:  # network, credentials, a store gone: the caller compiles itself
            self.failed(error, f"fetching {name}")
            return Fetched(FetchOutcome.UNAVAILABLE, why=self.problem or "")
        self.reached()
        self.events["fetched"] += 1
        return Fetched(FetchOutcome.HIT, manifest.get("about") or {})

    def _refused(self, name: str, reason: Refusal, why: str) -> Fetched:
        log.warning("artifact store %s: refused %s (%s): %s; compiling it here", shown_url(self.url), name, reason,
                    why)
        self.reached()
        self.events["rejected"] += 1
        self.events[reason] += 1
        return Fetched(FetchOutcome.REJECTED, why=f"{reason}: {why}", reason=reason)

    def _objects_of(self, name: str) -> list[str]:
        """NAME's objects in the store (whatever their checksum), manifests aside."""
        fs, _ = self.filesystem()
        parent, _, base = self._path(name).rpartition("/")
        fs.invalidate_cache(parent)
        try:
            found = fs.ls(parent, detail=False)
        except FileNotFoundError:
            return []
        return [path for path in found if path.rpartition("/")[2].startswith(base + ".")
                and not path.endswith(MANIFEST)]

    def publish(self, name: str, source: Path, about: dict, suffix: str = "") -> bool:
        """Upload `source` as NAME: its object first, then its manifest. Two hosts publishing one NAME at once both
        succeed: each manifest names an object complete before it, so whichever manifest stays is valid. A host that
        trusts keys but has none to sign with publishes nothing: its unsigned manifest would replace a signed one
        that every trusting host loads with one they all refuse."""
        if self.trust is not None and self.signer is None:
            if not self.events["unsigned_kept_here"]:
                log.warning("artifact store %s: %s is set but %s is not: packages compiled here stay here (an "
                            "unsigned one would be refused by every host that trusts keys)", shown_url(self.url),
                            TRUST_SETTING, SIGNING_KEY_SETTING)
            self.events["unsigned_kept_here"] += 1
            return False
        if not self.available():
            return False
        try:
            fs, _ = self.filesystem()
            digest, size = sha256_of(source), source.stat().st_size
            obj = f"{name}.{digest[:16]}{suffix}"
            parent = self._path(name).rpartition("/")[0]
            local = "file" in _protocols(fs)
            if local:
                fs.makedirs(parent, exist_ok=True)
            manifest = {"name": name, "object": obj, "sha256": digest, "bytes": size, "about": about,
                        "published_by": socket.gethostname(), "published_at": time.time()}
            if self.signer is not None:
                manifest |= self.signer.sign(name, manifest)
            text = json.dumps(manifest, indent=1, sort_keys=True).encode()
            if local:  # a file opened for writing is seen half-written: write beside it, then rename over it
                aside = f"{parent}/.{uuid.uuid4().hex}.part"  # a dot name: no listing takes it for an artifact
                fs.put_file(str(source), aside)
                fs.mv(aside, self._path(obj))
                fs.pipe_file(aside, text)
                fs.mv(aside, self._path(name + MANIFEST))
            else:  # an object store's PUT is atomic: a reader sees the old object or the new one
                fs.put_file(str(source), self._path(obj))
                fs.pipe_file(self._path(name + MANIFEST), text)
        except Exception as error:
            self.failed(error, f"publishing {name}")
            return False
        self.reached()
        self.events["published"] += 1
        log.info("published %s to %s (%.1f MB)", name, shown_url(self.url), size / 2**20)
        return True

    def holds(self, name: str, source: Path) -> bool:
        """Whether the store has `source`'s bytes as NAME, signed by this process's key when it has one (so a push
        signs what was published unsigned or by another key); False too when the store cannot say."""
        if not self.available():
            return False
        try:
            fs, _ = self.filesystem()
            manifest = json.loads(fs.cat_file(self._path(name + MANIFEST)))
        except FileNotFoundError:
            return False
        except Exception as error:
            self.failed(error, f"reading {name}'s manifest")
            return False
        if not isinstance(manifest, dict) or manifest.get("sha256") != sha256_of(source):
            return False
        return self.signer is None or manifest.get("signed_by") == self.signer.key_id

    # --- the whole store (the `cache` command) ----------------------------------------------------------------------

    def entries(self, under: str = "") -> list[dict]:
        """Every artifact under a prefix: its manifest's facts, and objects no manifest names (`orphan`: uploads cut
        short or in flight, and the losers of two publications at once). Raises when the store cannot be read."""
        fs, root = self.filesystem()
        base = f"{root}/{under}".rstrip("/")
        fs.invalidate_cache(base)
        try:
            found = fs.find(base, detail=True)
        except FileNotFoundError:
            found = {}
        named, listed = set(), []
        for path in sorted(p for p in found if p.endswith(MANIFEST)):
            name = path[len(root) + 1:-len(MANIFEST)]
            try:
                manifest = json.loads(fs.cat_file(path))
                named.add(manifest["object"])
                listed.append({**manifest, "name": name, "present": f"{root}/{manifest['object']}" in found,
                               "signature_state": check(name, manifest, self.trust).facts()})
            except (ValueError, KeyError, TypeError):
                listed.append({"name": name, "object": None, "present": False, "broken": "manifest is not valid"})
        for path, info in sorted(found.items()):
            relative = path[len(root) + 1:]
            if not path.endswith(MANIFEST) and relative not in named:
                listed.append({"name": relative, "object": relative, "orphan": True, "bytes": info.get("size"),
                               "age_s": _age_seconds(info)})
        return listed

    def verify(self, entry: dict, scratch: Path) -> str | None:
        """Why a listed artifact cannot be loaded (a bad signature, its object missing, or bytes differing from its
        manifest), or None when it verifies: its object is downloaded into `scratch` and checksummed. A manifest
        unsigned or signed by a key this host does not trust is no problem of the artifact (another host may trust
        it): its `signature_state` says so."""
        if entry.get("orphan") or entry.get("broken"):
            return entry.get("broken") or "an object without a manifest"
        if entry["signature_state"]["state"] == SignatureState.BAD_SIGNATURE:
            return f"bad signature: {entry['signature_state']['why']}"
        if not entry["present"]:
            return f"its object {entry['object']} is missing"
        fs, root = self.filesystem()
        local = scratch / "verify.part"
        try:
            fs.get_file(f"{root}/{entry['object']}", str(local))
            size, digest = local.stat().st_size, sha256_of(local)
        finally:
            local.unlink(missing_ok=True)
        if (size, digest) != (entry["bytes"], entry["sha256"]):
            return (f"{size} bytes with sha256 {digest[:16]}…, its manifest says {entry['bytes']}, "
                    f"{entry['sha256'][:16]}…")
        return None

    def remove(self, entry: dict) -> list[str]:
        """Delete a listed artifact: its manifest (first, so no reader takes it meanwhile) and its object."""
        fs, root = self.filesystem()
        paths = [] if entry.get("orphan") else [f"{root}/{entry['name']}{MANIFEST}"]
        if entry.get("object"):
            paths.append(f"{root}/{entry['object']}")
        removed = []
        for path in paths:
            try:
                fs.rm_file(path)
                removed.append(path)
            except FileNotFoundError:
                pass
        return removed

    # --- a compiler's own cache folder (TPU), kept in step with the store -------------------------------------------

    def pull_folder(self, folder: Path, under: str) -> int:
        """Fetch every artifact published under `under` that `folder` lacks; returns how many came. Each is checked
        against its manifest as a package is."""
        if not self.available():
            return 0
        try:
            listed = [e for e in self.entries(under) if not e.get("orphan") and not e.get("broken")]
        except Exception as error:
            self.failed(error, f"listing {under}")
            return 0
        came = 0
        for entry in listed:
            target = folder / entry["name"][len(under) + 1:]
            if not target.exists() and self.fetch(entry["name"], target).outcome is FetchOutcome.HIT:
                came += 1
        return came

    def push_folder(self, folder: Path, under: str) -> int:
        """Publish every file of `folder` the store does not hold with the same checksum; returns how many went."""
        went = 0
        for path in sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith(".")):
            name = f"{under}/{path.relative_to(folder).as_posix()}"
            if not self.available():
                break
            if not self.holds(name, path) and self.publish(name, path, {"file": path.name}):
                went += 1
        return went

    def report(self) -> dict:
        """The store as /status shows it: where, whether it answers, since when it does not, what came and went;
        the key it signs with and the keys it trusts (None: none set, and `trust_warning` says what that means)."""
        return {"url": shown_url(self.url), "reachable": self.problem is None, "error": self.problem,
                "since": self.problem_since, **{event: self.events[event] for event in ("fetched", "published",
                                                                                          "rejected", "store_failed")},
                "rejections": {reason: self.events[reason] for reason in Refusal},
                "signing_key": self.signer and self.signer.key_id, "trusted_keys": self.trust and self.trust.key_ids,
                "trust_warning": None if self.trust is not None else NO_TRUST}


def _protocols(fs) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


def _age_seconds(info: dict) -> float | None:
    modified = info.get("LastModified") or info.get("mtime") or info.get("updated")
    if modified is None:
        return None
    stamp = modified.timestamp() if hasattr(modified, "timestamp") else float(modified)
    return max(0.0, time.time() - stamp)
