"""Precompiled transformers: AOTInductor packages saved per (model, inputs, hardware, toolchain), reused after restarts.

Inductor's own caches still leave a restart re-tracing the transformer with dynamo. An AOTInductor package is
the whole compiled transformer for one set of input shapes: loading it is a `dlopen`, no tracing, no codegen
(this is how Hugging Face's ZeroGPU "AoTI" Spaces start fast). Packages hold no weights
(`aot_inductor.package_constants_in_so=False`): every shape's package runs on the live module's parameters,
so a pipeline with twelve shapes holds its weights once.

Used for mode "compiled" on hardware with `Hardware.aot_artifacts` (inductor on CPU and CUDA) unless
ACCELDEMO_PRECOMPILE=off; Neuron and TPU keep their own persistent caches (NEFF, TPU tier-3).

With a shared store (ACCELDEMO_ARTIFACTS, see `remote`), a local miss is looked up there before compiling, and
every package built here is published there: a fresh host's first visit to a shape built elsewhere is a download.
Published manifests are signed with ACCELDEMO_ARTIFACTS_SIGNING_KEY, and with ACCELDEMO_ARTIFACTS_TRUST set only
packages signed by a listed key are loaded (see `signing`).
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import inspect
import json
import logging
import os
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

from ..records import Phase
from .remote import STORE_EVENTS, Fetched, FetchOutcome, Refusal, RemoteArtifacts
from .signing import Signer, Trust

log = logging.getLogger("acceldemo.artifacts")

# What can happen to a package: built here, loaded from the local folder, refused as unusable (a local file cut
# short, or a store's object failing its checksum), fetched from the shared store, published to it, or a store
# operation that failed (the store unreachable).
EVENTS = ("built", "loaded", "rejected", *STORE_EVENTS)
# What a call's package events carry: EVENTS, and each store refusal by its reason (`Refusal`: checksum, incomplete,
# unsigned, bad_signature, untrusted_key), which /metrics counts and the request's facts show.
COUNTED = (*EVENTS, *Refusal)


class ArtifactStore:
    """One folder of packages, each written atomically beside a JSON file saying what it is; and what its owner
    (the engine) has seen happen to them since start."""

    def __init__(self, root: Path, remote: RemoteArtifacts | None = None):
        self.root = Path(root)
        self.remote = remote
        self.events: Counter = Counter()

    def record(self, events: dict[str, int], store_problem: str | None = None) -> None:
        """Add one call's package events (built, loaded, rejected, fetched, published, store_failed), wherever the call
        ran; and, when the call used the shared store, what it found of it (`store_problem`, None: it answered)."""
        self.events.update({event: count for event, count in events.items() if event in COUNTED})
        if self.remote is not None and any(events.get(event) for event in STORE_EVENTS):
            self.remote.note(store_problem)

    def counts(self) -> dict[str, int]:
        """Every event's count since start (EVENTS: built, loaded, rejected, fetched, published, store_failed):
        counts only, no disk access."""
        return {event: self.events[event] for event in EVENTS}

    def rejections(self) -> dict[str, int]:
        """The shared store's refusals since start, by reason (every `Refusal`, 0 included)."""
        return {str(reason): self.events[reason] for reason in Refusal}

    @classmethod
    def of(cls, settings) -> ArtifactStore:
        """The app's store, in its persistent cache dir, with the shared store behind it when one is set, signing
        and checking as set. A signing key or trust file that cannot be used is refused here, at start-up, with a
        ValueError naming the setting (also without a store: a typo shows before the store is added)."""
        signer = Signer.from_file(settings.artifacts_signing_key) if settings.artifacts_signing_key else None
        trust = Trust.from_file(settings.artifacts_trust) if settings.artifacts_trust else None
        remote = RemoteArtifacts.shared(settings.artifacts, settings.artifacts_options, signer, trust) \
            if settings.artifacts else None
        return cls(settings.cache_dir / "aoti", remote)

    def remote_name(self, path: Path) -> str:
        """A local package's name in the shared store: the same key, under `aoti/`."""
        return f"aoti/{path.relative_to(self.root).with_suffix('').as_posix()}"

    def fetch(self, path: Path) -> Fetched | None:
        """Bring a package this folder lacks from the shared store, verified, with its JSON; None without a store."""
        if self.remote is None:
            return None
        fetched = self.remote.fetch(self.remote_name(path), path)
        if fetched.outcome is FetchOutcome.HIT:
            path.with_suffix(".json").write_text(json.dumps(fetched.about, indent=1, sort_keys=True))
        return fetched

    def publish(self, path: Path) -> bool:
        """Put a local package (and its JSON's facts) in the shared store; False without one or when it fails."""
        if self.remote is None:
            return False
        about = json.loads(path.with_suffix(".json").read_text())
        return self.remote.publish(self.remote_name(path), path, about, suffix=".pt2")

    def push(self, keep: Callable[[dict], bool] = lambda entry: True) -> list[str]:
        """Publish the local packages (those `keep` accepts) the shared store lacks, holds with other bytes, or holds
        unsigned by this host's signing key; returns their paths."""
        pushed = []
        for entry in self.packages():
            path = Path(entry["path"])
            if "toolchain" not in entry or not keep(entry):
                continue
            if not self.remote.holds(self.remote_name(path), path) and self.publish(path):
                pushed.append(str(path))
        return pushed

    def path(self, model: str, hardware: str, key: dict) -> Path:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
        return self.root / model / hardware / f"{digest}.pt2"

    @contextlib.contextmanager
    def building(self, path: Path, waiting: Callable[[], None] = lambda: None) -> Iterator[None]:
        """Hold a package's lock: of processes sharing the store (replicas, app instances on one cache folder)
        asking for the same package at once, one builds it and the others wait (`waiting` is called when they
        must), then load what it saved."""
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_suffix(".lock"), "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                waiting()
                fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def save(self, path: Path, build: Callable[[str], object], about: dict) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".partial-{os.getpid()}-{path.name}")
        try:
            build(str(partial))
            os.replace(partial, path)
        finally:
            partial.unlink(missing_ok=True)
        path.with_suffix(".json").write_text(json.dumps(about, indent=1, sort_keys=True))

    def sync_compiler_cache(self, hardware, push: bool) -> int:
        """Keep a hardware's own compiler cache folder (`Hardware.synced_cache_env`: TPU's tier-3 cache) in step with
        the shared store, under a prefix of its hardware generation and toolchain: pull what the folder lacks (before
        a first visit), or push what the store lacks (after a compile). Returns the files moved (counted as fetched
        or published); 0 without a store or such a folder."""
        variable = hardware.synced_cache_env
        folder = os.environ.get(variable) if variable else None
        if self.remote is None or not folder:
            return 0
        scope = json.dumps([hardware.name, hardware.detect().generation, hardware.toolchain()])
        under = f"{hardware.name}-cache/{hashlib.sha256(scope.encode()).hexdigest()[:16]}"
        moved = self.remote.push_folder(Path(folder), under) if push else self.remote.pull_folder(Path(folder), under)
        self.events["published" if push else "fetched"] += moved
        return moved

    def packages(self) -> list[dict]:
        """Every package on disk with what its JSON says it is (`model`, `shape`, `toolchain`, ...), its size and
        age; a package without its JSON (a crash between the two writes) has only `path` and `megabytes`."""
        found = []
        for package in self._files():
            about = package.with_suffix(".json")
            try:
                facts = json.loads(about.read_text()) if about.exists() else {}
                found.append({**facts, "path": str(package), "megabytes": round(package.stat().st_size / 2**20, 2),
                              "age_days": round((time.time() - package.stat().st_mtime) / 86400, 1)})
            except (OSError, ValueError):  # removed meanwhile, or a JSON cut short: listed without facts
                found.append({"path": str(package), "megabytes": 0.0})
        return found

    def _files(self) -> list[Path]:
        """The finished packages (a build in progress writes a hidden `.partial-*` file)."""
        found = self.root.glob("*/*/*.pt2") if self.root.is_dir() else ()
        return sorted(path for path in found if not path.name.startswith("."))

    def prune(self, current_toolchain: Callable[[str], str | None]) -> list[str]:
        """Delete what can no longer be loaded here: packages whose toolchain differs from this host's for their
        hardware (`current_toolchain(hardware)`; None keeps them: that hardware is not here to ask), packages
        without their JSON, and `.partial-*` leftovers of builds killed mid-write. Returns the removed paths."""
        removed = []
        for entry in self.packages():
            hardware, toolchain = entry.get("hardware"), entry.get("toolchain")
            wanted = current_toolchain(hardware) if hardware else None
            if toolchain is None or (wanted is not None and toolchain != wanted):
                package = Path(entry["path"])
                package.unlink(missing_ok=True)
                package.with_suffix(".json").unlink(missing_ok=True)
                removed.append(str(package))
        for partial in self.root.glob("*/*/.partial-*") if self.root.is_dir() else ():
            partial.unlink(missing_ok=True)
            removed.append(str(partial))
        return removed

    def report(self, setting: str) -> dict:
        """The store as a person reads it: the setting, packages on disk, builds and loads since start
        (loaded ÷ (loaded + built): the restart hit rate)."""
        files = self._files()
        done = self.counts()
        reused, built = done["loaded"], done["built"]
        return {"setting": setting, "folder": str(self.root), "packages": len(files),
                "megabytes": round(sum(f.stat().st_size for f in files) / 2**20, 1), **done,
                "hit_rate": round(reused / (reused + built), 3) if reused + built else None,
                "store": self.store_report()}

    def store_report(self) -> dict | None:
        """The shared store as /status and the page show it (None without one): where it is, whether it answers
        (and the error since when it does not), and what its owner's calls fetched, published and failed to."""
        if self.remote is None:
            return None
        return {**self.remote.report(), **{event: self.events[event] for event in STORE_EVENTS},
                "rejected": self.events["rejected"], "rejections": self.rejections()}


def _empty_dict(value) -> bool:
    return isinstance(value, dict) and not value


def weights_fingerprint(module) -> str:
    """Which weights a module holds, cheaply: the Hub revision its files came from when they came from the Hub cache,
    else a hash of every parameter's name, shape, dtype and first 4096 values. Packages hold no weights (they run on
    the live module's), so this keeps one checkpoint's packages apart from another's without reading gigabytes."""
    import torch

    source = str(getattr(module.config, "_name_or_path", "") or "")
    parts = Path(source).parts
    if "snapshots" in parts and parts.index("snapshots") + 1 < len(parts):
        return f"revision {parts[parts.index('snapshots') + 1]}"
    digest = hashlib.sha256()
    with torch.no_grad():
        for name, tensor in sorted(module.state_dict().items()):
            digest.update(f"{name}{list(tensor.shape)}{tensor.dtype}".encode())
            sample = tensor.detach().reshape(-1)[:4096].to("cpu")
            digest.update(sample.view(torch.uint8).numpy().tobytes() if sample.numel() else b"")
    return f"sha256 {digest.hexdigest()[:16]}"


@contextlib.contextmanager
def _isa_taken_from_the_key() -> Iterator[None]:
    """Load a package without inductor's CPU vector-ISA probe.

    `aoti_load_package` asks inductor which vector ISA this CPU has only to warn when it differs from the package's;
    in a process that has not compiled yet (a fresh host), answering compiles and runs a probe program per candidate
    ISA (seconds each: most of a fresh host's first image). The package key already holds the CPU's ISA as ATen
    detects it (`Hardware.toolchain`), so a package built for another ISA is never offered here; inductor's own
    `cpp.vec_isa_ok` switch skips the probe for this load, and the list is forgotten after it, so a later compile in
    this process probes as usual."""
    from torch._inductor import config, cpu_vec_isa

    if cpu_vec_isa.valid_vec_isa_list.cache_info().currsize:  # probed already in this process: nothing to save
        yield
        return
    try:
        with config.patch({"cpp.vec_isa_ok": True}):
            yield
    finally:
        cpu_vec_isa.valid_vec_isa_list.cache_clear()


def _diffusers_version() -> str:
    """The model code a package was traced from is diffusers' (the config's own `_diffusers_version` is the one it
    was saved with)."""
    import diffusers

    return diffusers.__version__


def _signature(inputs: dict) -> list:
    """The inputs a package is compiled for: every tensor's shape, dtype and device, every other value."""
    import torch

    return [[name, [list(value.shape), str(value.dtype), str(value.device)] if torch.is_tensor(value)
             else repr(value)] for name, value in sorted(inputs.items())]


class PrecompiledTransformer:
    """Stands in for `transformer.forward`: one AOTInductor package per input signature, built once, saved."""

    def __init__(self, transformer, store: ArtifactStore, model: str, hardware, placement: str = "device"):
        self.transformer, self.store, self.model, self.hardware = transformer, store, model, hardware
        self.parameters = inspect.signature(type(transformer).forward).parameters
        # The config's own fields; its private ones ("_name_or_path": where this host keeps the files) differ by host.
        config = json.dumps({k: v for k, v in dict(transformer.config).items() if not k.startswith("_")},
                            sort_keys=True, default=str)
        # Everything that makes a package valid, so that any difference is a miss, never a wrong load (a package
        # for one pipeline in one process: placement device, no tensor parallelism).
        self.scope = {"model": model, "class": type(transformer).__name__, "weights": weights_fingerprint(transformer),
                      "config": hashlib.sha256(config.encode()).hexdigest()[:16], "placement": str(placement),
                      "tp_size": 1, "hardware": hardware.name, "generation": hardware.detect().generation,
                      "toolchain": hardware.toolchain(), "code": f"diffusers {_diffusers_version()}"}
        self.runners: dict[str, Callable] = {}
        self.warned_eager = False
        # Set by the caller around one pipeline call: what the shape is called, where phase changes go, and what
        # happened to packages during it ("built", "loaded", "rejected", "build_seconds").
        self.label, self.notify = "", lambda phase, text: None
        self.events: Counter = Counter()

    @classmethod
    def install(cls, pipe, store: ArtifactStore, model: str, hardware,
                placement: str = "device") -> PrecompiledTransformer:
        precompiled = cls(pipe.transformer, store, model, hardware, placement)
        pipe.transformer.forward = precompiled
        return precompiled

    def __call__(self, *args, **kwargs):
        inputs = {name: value for name, value in zip(list(self.parameters)[1:], args)} | kwargs
        # None and {} (FluxPipeline's joint_attention_kwargs) are what a package is traced without.
        inputs = {name: value for name, value in inputs.items() if value is not None and not _empty_dict(value)}
        if any(isinstance(value, dict) for value in inputs.values()):  # e.g. LoRA scales: not part of a package
            if not self.warned_eager:
                log.warning("%s called with %s: such calls run eagerly", self.model, sorted(inputs))
                self.warned_eager = True
            return self._eager(**inputs)
        key = json.dumps(_signature(inputs))
        runner = self.runners.get(key) or self._runner(key, inputs)
        return runner(**inputs)

    def _eager(self, **inputs):
        return type(self.transformer).forward(self.transformer, **inputs)

    def _runner(self, key: str, inputs: dict) -> Callable:
        path = self.store.path(self.model, self.hardware.name, {**self.scope, "inputs": key})
        def waiting() -> None:
            self.notify(Phase.COMPILE, f"waiting for another process compiling {self.label} (it saves the package for "
                                   "this one)")

        with self.store.building(path, waiting):
            runner = self._load(path) if path.exists() else None
            if runner is None and self._fetch(path):
                runner = self._load(path)
            if runner is None:
                runner = self._build(path, inputs)
        self.runners[key] = runner
        return runner

    def _fetch(self, path: Path) -> bool:
        """Whether the shared store had this package (verified, now in the local folder). A refused one (checksum
        mismatch, upload cut short, a signature this host does not accept) counts as rejected and by its reason; a
        store that cannot be reached, as store_failed."""
        if self.store.remote is None:
            return False
        self.notify(Phase.LOAD, f"looking for {self.label}'s precompiled transformer in the shared artifact store")
        fetched = self.store.fetch(path)
        event = {FetchOutcome.HIT: "fetched", FetchOutcome.REJECTED: "rejected",
                 FetchOutcome.UNAVAILABLE: "store_failed"}.get(fetched.outcome)
        if event:
            self.events[event] += 1
        if fetched.reason is not None:
            self.events[fetched.reason] += 1
            self.notify(Phase.COMPILE, f"the shared store's package for {self.label} was refused ({fetched.why}); "
                                       "compiling it here")
        return fetched.outcome is FetchOutcome.HIT

    def _load(self, path: Path) -> Callable | None:
        self.notify(Phase.LOAD, f"loading the precompiled transformer for {self.label} ({path.name})")
        started = time.perf_counter()
        try:
            runner = self._open(path)
        except Exception as error:  # truncated by a crash, or built by another toolchain: build it again
            log.warning("precompiled package %s unusable (%s: %s); rebuilding", path, type(error).__name__, error)
            self.events["rejected"] += 1
            path.unlink(missing_ok=True)
            return None
        self.events["loaded"] += 1
        log.info("loaded %s for %s in %.2f s", path.name, self.label, time.perf_counter() - started)
        return runner

    def _build(self, path: Path, inputs: dict) -> Callable:
        import torch

        self.notify(Phase.COMPILE, f"compiling {self.label} ahead of time with AOTInductor (first time for this "
                               "shape; saved for restarts)")
        started = time.perf_counter()
        del self.transformer.forward  # export traces the class's own forward, not this stand-in
        try:
            program = torch.export.export(self.transformer, (), inputs, strict=False)
        finally:
            self.transformer.forward = self
        self.store.save(path, lambda target: torch._inductor.aoti_compile_and_package(
            program, package_path=target, inductor_configs={"aot_inductor.package_constants_in_so": False}),
            {**self.scope, "inputs": _signature(inputs), "shape": self.label})
        runner = self._open(path)
        seconds = time.perf_counter() - started
        self.events["built"] += 1
        self.events["build_seconds"] += seconds
        log.info("built %s for %s in %.1f s", path.name, self.label, seconds)
        if self.store.remote is not None:
            self.notify(Phase.COMPILE, f"publishing {self.label}'s package to the shared artifact store")
            self.events["published" if self.store.publish(path) else "store_failed"] += 1
        return runner

    def weights_changed(self) -> None:
        """The live module's tensors were written in place (a LoRA style swapped in, its strength set): every
        loaded package takes them again, so what inductor folded from them at load is folded anew."""
        for runner in self.runners.values():
            self._give_weights(runner)

    def _give_weights(self, runner) -> None:
        # Every name a tensor goes by (tensors shared by several modules, as LoRA strengths can be, included).
        weights = dict(self.transformer.named_parameters(remove_duplicate=False)) | \
            dict(self.transformer.named_buffers(remove_duplicate=False))
        runner.load_constants(weights, check_full_update=True, user_managed=True)

    def _open(self, path: Path) -> Callable:
        """The package's compiled transformer, running on this transformer's own weights."""
        import torch

        with warnings.catch_warnings(), _isa_taken_from_the_key():
            # torch's own pytree deprecation, raised while unpickling the package
            warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
            runner = torch._inductor.aoti_load_package(str(path))
        self._give_weights(runner)
        return runner
