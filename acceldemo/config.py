"""Every operator setting (each an ACCELDEMO_* variable, read here and nowhere else), built once by an entry point
and passed down; and what the app hands the worker processes it starts."""
from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

# Handed by the app to the worker processes it starts (never on their command line): the pool's secret, the app's
# pid (ranks leave when it is gone) and the app's settings, so both sides of a pool read the same limits.
POOL_SECRET_VARIABLE = "ACCELDEMO_POOL_AUTHKEY"
POOL_APP_PID_VARIABLE = "ACCELDEMO_POOL_APP_PID"
POOL_SETTINGS_VARIABLE = "ACCELDEMO_POOL_SETTINGS"
# The most requests one pipeline call may take, whatever an operator sets (ACCELDEMO_MAX_BATCH).
MAX_BATCH = 16
_MEMORY_VARIABLE = re.compile(r"^ACCELDEMO_([A-Z0-9]+)_MEMORY_GB$")


class _Env:
    """Settings' reader of the environment: each value by its name, checked, or the error naming what is accepted."""

    def __init__(self, environ):
        self.environ = environ

    @property
    def names(self):
        return list(self.environ)

    def text(self, name: str, default: str | None = None) -> str | None:
        return self.environ.get(name) or default

    def number(self, name: str, default: float, kind=float):
        value = self.environ.get(name)
        if value in (None, ""):
            return default
        try:
            return kind(value)
        except ValueError:
            raise ValueError(f"{name}={value!r} is not accepted: a {'whole ' if kind is int else ''}number") from None

    def bounded(self, name: str, default, low: float, high: float, kind=float):
        value = self.number(name, default, kind)
        if value is not None and not low <= value <= high:
            raise ValueError(f"{name}={self.environ.get(name)!r} is not accepted: a {'whole ' if kind is int else ''}"
                             f"number from {low:g} to {high:g}")
        return value

    def json_object(self, name: str) -> dict:
        value = self.environ.get(name)
        if not value:
            return {}
        try:
            parsed = json.loads(value)
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            raise ValueError(f"{name}={value!r} is not accepted: a JSON object, e.g. " + JSON_EXAMPLES.get(name, "{}"))
        return parsed

    def switch(self, name: str, default: bool) -> bool:
        value = (self.environ.get(name) or "").strip().lower()
        if not value:
            return default
        if value not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            raise ValueError(f"{name}={self.environ.get(name)!r} is not accepted: 1 or 0 (true or false)")
        return value in ("1", "true", "yes", "on")

    def choice(self, name: str, default: str, accepted: tuple[str, ...]) -> str:
        value = self.environ.get(name) or default
        if value not in accepted:
            raise ValueError(f"{name}={value!r} is not accepted: accepted values are {', '.join(accepted)}")
        return value


@dataclass(frozen=True)
class Settings:
    """What an operator can set. Each field is read from one ACCELDEMO_* variable by `from_env`; the server's address
    also from Gradio's own variables and PORT."""

    # Embedded models and every compiler cache (inductor, NEFF, TPU, precompiled packages).
    cache_dir: Path
    # Resident pipelines per device; the least recently used idle one is evicted beyond.
    max_resident_pipelines: int = 3
    # Shapes per pipeline; dynamo's recompile limit is sized from it.
    max_shapes_per_pipeline: int = 32
    # Folder holding real models as <org>/<name>.
    model_dir: Path | None = None
    # "auto": mode compiled on CPU/CUDA builds AOTInductor packages per shape and reuses them after restarts;
    # "off": plain torch.compile with inductor's own caches.
    precompile: str = "auto"
    # Longest wait in line for a device before a request is answered "busy, retry".
    device_wait_s: float = 600.0
    # Requests waiting in the engine's line (every front end's); one more is refused at once with QueueFull.
    queue_size: int = 64
    # How many of one client's requests may wait at once (ACCELDEMO_CLIENT_QUEUE); None: a quarter of the line (at
    # least 2), so one client's burst leaves room for three others (see `client_queue_limit`).
    client_queue: int | None = None
    # Requests that share one pipeline call at most (same pipeline, shape, steps, guidance); None: what the model's
    # catalog entry and the device's memory allow; 1 turns batching off.
    max_batch: int | None = None
    # How long a call that could take more requests waits for them once its device is free; 0: it takes only those
    # already waiting (a lone request is never held back).
    batch_wait_ms: float = 0.0
    # Longest one worker-pool command (start, load, request) may take before the pool counts as hung and is stopped;
    # the ranks' own process-group timeout is the same number.
    pool_timeout_s: float = 1800.0
    # How long /ready waits for the start-up warm-up before the app serves anyway (the warm-up itself goes on).
    warmup_timeout_s: float = 1800.0
    # Longest a hardware probe (a child process importing the backend) may take before it counts as absent.
    probe_timeout_s: float = 60.0
    # Device memory per hardware, in GB, where the probe cannot read it or an operator knows better.
    device_memory_gb: dict[str, float] = field(default_factory=dict)
    # torch.compile backend on CPU: inductor is the real one; tests and quick demos may pick aot_eager.
    cpu_compile_backend: str = "inductor"
    # The model a request that names none gets (and the page shows first).
    default_model: str = "tiny-shapes"
    # Copies of a pipeline, one per device set, per hardware ("*" for every hardware): requests go to whichever is
    # free. Unset: what the placement proposal says (every device of an accelerator; one on CPU).
    replicas: dict[str, int] = field(default_factory=dict)
    # How many devices the CPU's cores are split into (each a replica's own cores); unset: the CPU's replicas, or 1.
    cpu_devices: int | None = None
    # Hosts a tensor-parallel pool spans (this one is node 0), and where the other nodes join when more than one.
    pool_nnodes: int = 1
    pool_rdzv_endpoint: str | None = None
    # The server: bind address and port, compile at start (MODE:WxH,...), login for the page, token for /status,
    # /metrics and the /v1 API. The address is Gradio's GRADIO_SERVER_NAME / GRADIO_SERVER_PORT when set (a Gradio
    # Space sets them and sends its traffic there), else ACCELDEMO_HOST / PORT.
    host: str = "127.0.0.1"
    port: int = 7860
    warmup: str | None = None
    auth: str | None = None
    api_token: str | None = None
    # Keys (acceldemo/ui/keys.py): a file of client keys (`NAME SHA256` lines) that /v1 and the MCP server ask for,
    # and the operator key (itself, or a file holding it) for /status, /metrics and the page's operator actions.
    api_keys: str | None = None
    admin_key: str | None = None
    admin_key_file: str | None = None
    # A Ray cluster whose nodes run the pipeline replicas as a Ray Serve deployment (`auto`: the cluster `ray start`
    # began on this host); None: this host's own devices, no Ray.
    ray_address: str | None = None
    # Join that cluster without Ray's token authentication (ACCELDEMO_RAY_INSECURE=1, with a warning at start). Off:
    # the app joins only with RAY_AUTH_MODE=token and the cluster's token (fleet/ray_fleet.py, `ray_auth`), since
    # whoever reaches an unauthenticated cluster's GCS port can run code on every node.
    ray_insecure: bool = False
    # Ray Serve's autoscaling of those replicas (min_replicas — 0 scales to zero —, max_replicas,
    # target_ongoing_requests, ...); empty: a fixed number of replicas (--replicas, else one per device on the cluster).
    ray_autoscaling: dict = field(default_factory=dict)
    # The shared artifact store behind the local cache folder, read on a local miss and written after every compile
    # (see executors/remote.py): a folder on a shared filesystem, s3://bucket/prefix, gs://bucket/prefix or
    # hf://datasets/ORG/NAME. Only the operator sets it: no request can name a store. None: this host's folder only.
    artifacts: str | None = None
    # Options for the store's fsspec filesystem (s3fs, gcsfs, HfFileSystem), e.g.
    # {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}}; credentials are best left to each library's own
    # variables and files (AWS_*, GOOGLE_APPLICATION_CREDENTIALS, HF_TOKEN).
    artifacts_options: dict = field(default_factory=dict)
    # A PEM (PKCS8) Ed25519 private key: every manifest this host publishes to the store is signed with it. A file of
    # PEM Ed25519 public keys: with it, a package from the store loads only when signed by one of them (unsigned,
    # badly signed and otherwise signed ones are refused and compiled here). Read and checked at start-up by
    # executors/signing.py; None: manifests unsigned, and any package loads on its checksum (a warning says so).
    artifacts_signing_key: Path | None = None
    artifacts_trust: Path | None = None
    # LoRA styles: <dir>/<model>/<name>.safetensors (as diffusers/PEFT save them, or a format diffusers' loaders
    # convert), offered beside the styles a model ships with; None: only those.
    lora_dir: Path | None = None
    # Entries of the exact-result cache: a request identical in every value that shapes the image is answered with
    # the images an earlier one drew; 0 turns it off. Default 0, or 32 in a Hugging Face Space (SPACE_ID set), where
    # most visitors click the same example prompts at the same seed.
    result_cache: int = 0
    # Whether a real model missing here is fetched from the Hugging Face Hub (HF_TOKEN for gated repositories,
    # HF_ENDPOINT for another hub: huggingface_hub reads both). Default off, or on in a Space (SPACE_ID set) unless
    # HF_HUB_OFFLINE is set.
    download: bool = False
    # Whether the app is also a Model Context Protocol server (Gradio's, at /gradio_api/mcp/): its tools are
    # acceldemo/ui/mcp_tools.py's. Off by default: an MCP client is one more door a person must mean to open.
    mcp: bool = False
    # ZeroGPU (hardware/zerogpu.py, on with SPACES_ZERO_GPU): the slice each draw asks for (large: half an H200;
    # xlarge: a whole one), and the seconds a draw asks for before this model, shape and batch have a measured step
    # time (the platform's own default is 60); after that: steps x the step time measured, plus the margin.
    zero_gpu_size: str = "large"
    zero_gpu_first_s: float = 60.0
    zero_gpu_margin_s: float = 10.0
    # ... and what a call that builds a compiled package asks for (a warm-up: visitors' calls never compile there).
    zero_gpu_compile_s: float = 600.0

    @staticmethod
    def from_env(environ: dict[str, str] | None = None) -> Settings:
        env = _Env(os.environ if environ is None else environ)
        text, number, bounded, json_object, switch, choice = (env.text, env.number, env.bounded, env.json_object,
                                                              env.switch, env.choice)
        default_cache = default_cache_dir()
        model_dir = text("ACCELDEMO_MODEL_DIR")
        memory = {match[1].lower(): number(name, 0.0) for name in env.names if (match := _MEMORY_VARIABLE.match(name))}
        return Settings(
            cache_dir=Path(text("ACCELDEMO_CACHE_DIR", str(default_cache))),
            max_resident_pipelines=number("ACCELDEMO_MAX_RESIDENT", 3, int),
            max_shapes_per_pipeline=number("ACCELDEMO_MAX_SHAPES", 32, int),
            model_dir=Path(model_dir) if model_dir else None,
            precompile=choice("ACCELDEMO_PRECOMPILE", "auto", ("auto", "off")),
            device_wait_s=number("ACCELDEMO_DEVICE_WAIT_S", 600.0),
            queue_size=number("ACCELDEMO_QUEUE_SIZE", 64, int),
            client_queue=bounded("ACCELDEMO_CLIENT_QUEUE", None, 1, 100_000, int),
            max_batch=bounded("ACCELDEMO_MAX_BATCH", None, 1, MAX_BATCH, int),
            batch_wait_ms=bounded("ACCELDEMO_BATCH_WAIT_MS", 0.0, 0, 10_000),
            pool_timeout_s=number("ACCELDEMO_POOL_TIMEOUT_S", 1800.0),
            warmup_timeout_s=number("ACCELDEMO_WARMUP_TIMEOUT_S", 1800.0),
            probe_timeout_s=number("ACCELDEMO_PROBE_TIMEOUT_S", 60.0),
            device_memory_gb={name: gb for name, gb in memory.items() if gb > 0},
            cpu_compile_backend=text("ACCELDEMO_CPU_COMPILE_BACKEND", "inductor"),
            # ACCELDEMO_MODEL: the shorter name a Space's variables may use.
            default_model=text("ACCELDEMO_DEFAULT_MODEL") or text("ACCELDEMO_MODEL", "tiny-shapes"),
            replicas=per_hardware("ACCELDEMO_REPLICAS", text("ACCELDEMO_REPLICAS")),
            cpu_devices=number("ACCELDEMO_CPU_DEVICES", None, int),
            pool_nnodes=max(number("ACCELDEMO_POOL_NNODES", 1, int), 1),
            pool_rdzv_endpoint=text("ACCELDEMO_POOL_RDZV_ENDPOINT"),
            host=text("GRADIO_SERVER_NAME") or text("ACCELDEMO_HOST", "127.0.0.1"),
            port=number("GRADIO_SERVER_PORT", number("PORT", 7860, int), int),
            warmup=text("ACCELDEMO_WARMUP"),
            auth=text("ACCELDEMO_AUTH"),
            api_token=text("ACCELDEMO_API_TOKEN"),
            api_keys=text("ACCELDEMO_API_KEYS"),
            admin_key=text("ACCELDEMO_ADMIN_KEY"),
            admin_key_file=text("ACCELDEMO_ADMIN_KEY_FILE"),
            ray_address=text("ACCELDEMO_RAY_ADDRESS"),
            ray_insecure=switch("ACCELDEMO_RAY_INSECURE", False),
            ray_autoscaling=json_object("ACCELDEMO_RAY_AUTOSCALING"),
            artifacts=store_url(text("ACCELDEMO_ARTIFACTS")),
            artifacts_options=json_object("ACCELDEMO_ARTIFACTS_OPTIONS"),
            artifacts_signing_key=Path(text("ACCELDEMO_ARTIFACTS_SIGNING_KEY"))
            if text("ACCELDEMO_ARTIFACTS_SIGNING_KEY") else None,
            artifacts_trust=Path(text("ACCELDEMO_ARTIFACTS_TRUST")) if text("ACCELDEMO_ARTIFACTS_TRUST") else None,
            lora_dir=Path(text("ACCELDEMO_LORA_DIR")) if text("ACCELDEMO_LORA_DIR") else None,
            result_cache=bounded("ACCELDEMO_RESULT_CACHE", 32 if text("SPACE_ID") else 0, 0, 10_000, int),
            download=switch("ACCELDEMO_DOWNLOAD", bool(text("SPACE_ID")) and not text("HF_HUB_OFFLINE")),
            mcp=switch("ACCELDEMO_MCP", False),
            zero_gpu_size=choice("ACCELDEMO_ZEROGPU_SIZE", "large", ("large", "xlarge")),
            zero_gpu_first_s=bounded("ACCELDEMO_ZEROGPU_FIRST_S", 60.0, 1, 1500),
            zero_gpu_margin_s=bounded("ACCELDEMO_ZEROGPU_MARGIN_S", 10.0, 0, 600),
            zero_gpu_compile_s=bounded("ACCELDEMO_ZEROGPU_COMPILE_S", 600.0, 1, 1500),
        )

    @property
    def client_queue_limit(self) -> int:
        """One client's share of the line: ACCELDEMO_CLIENT_QUEUE, else a quarter of ACCELDEMO_QUEUE_SIZE but at
        least 2 (a person may queue a second request behind the first); never more than the line."""
        share = self.client_queue if self.client_queue is not None else max(2, self.queue_size // 4)
        return max(0, min(share, self.queue_size))

    def replicas_of(self, hardware: str) -> int | None:
        """The operator's replica count for a hardware, or None to follow the placement proposal."""
        return self.replicas.get(hardware, self.replicas.get("*"))

    def to_json(self) -> str:
        return json.dumps({k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(self).items()})

    @staticmethod
    def from_json(text: str) -> Settings:
        values = json.loads(text)
        paths = {"cache_dir", "model_dir", "lora_dir", "artifacts_signing_key", "artifacts_trust"}
        return Settings(**{k: Path(v) if k in paths and v is not None else v for k, v in values.items()})


# A Space's persistent storage, when one is attached: the caches go there if it is writable (ACCELDEMO_CACHE_DIR unset).
DATA_VOLUME = Path("/data")


def default_cache_dir(data: Path = DATA_VOLUME, home: Path | None = None) -> Path:
    """The cache folder when ACCELDEMO_CACHE_DIR is unset: <data>/acceldemo where `data` is a writable folder (a
    persistent volume), else ~/.cache/acceldemo (a container without a volume, whose user cannot create /data)."""
    if data.is_dir() and os.access(data, os.W_OK | os.X_OK):
        return data / "acceldemo"
    return (Path.home() if home is None else home) / ".cache" / "acceldemo"


def cache_dir_note(settings: Settings, environ: dict[str, str] | None = None, data: Path = DATA_VOLUME) -> str:
    """One line for the start-up log: the cache folder in use and why that one."""
    env = os.environ if environ is None else environ
    if env.get("ACCELDEMO_CACHE_DIR"):
        why = "set by ACCELDEMO_CACHE_DIR"
    elif settings.cache_dir == data / "acceldemo":
        why = f"{data} is writable (a persistent volume)"
    else:
        why = f"{data} is absent or not writable: no persistent volume, caches live in the home folder"
    return f"cache directory {settings.cache_dir} ({why})"


JSON_EXAMPLES = {"ACCELDEMO_RAY_AUTOSCALING": '{"min_replicas": 0, "max_replicas": 4}',
                 "ACCELDEMO_ARTIFACTS_OPTIONS": '{"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}}'}


def store_url(url: str | None, name: str = "ACCELDEMO_ARTIFACTS") -> str | None:
    """A shared store's URL as given, when its scheme is a storage protocol fsspec knows or it is a path; None when
    unset. fsspec comes with huggingface_hub (a diffusers dependency); the protocol's own client (s3fs, gcsfs) is
    asked for only when the store is first used."""
    url = (url or "").strip()
    if not url:
        return None
    scheme, sep, _ = url.partition("://")
    if not sep or scheme in ("file", "local"):
        return url
    from fsspec.registry import known_implementations, registry

    if scheme not in known_implementations and scheme not in registry:
        raise ValueError(f"{name}={url!r} is not accepted: {scheme}:// is not a storage protocol fsspec knows; use "
                         "a folder path (a shared filesystem), s3://bucket/prefix, gs://bucket/prefix or "
                         "hf://datasets/ORG/NAME")
    return url


def per_hardware(name: str, value: str | None) -> dict[str, int]:
    """A count for every hardware (`N`, kept under "*") or per hardware (`cpu=2,cuda=4`); {} when unset."""
    value = (value or "").strip()
    if not value:
        return {}
    counts: dict[str, int] = {}
    try:
        for part in value.split(","):
            hardware, _, count = part.rpartition("=")
            counts[hardware.strip() or "*"] = int(count)
    except ValueError:
        counts = {}
    if not counts or min(counts.values()) < 1:
        raise ValueError(f"{name}={value!r} is not accepted: a whole number of at least 1, or per hardware as "
                         "cpu=2,cuda=4")
    return counts


@dataclass(frozen=True)
class PoolLaunch:
    """What the app hands every rank of a pool it starts: the channel's secret, its own pid, its settings."""

    authkey: bytes
    app_pid: int | None
    settings: Settings

    def environment(self) -> dict[str, str]:
        return {POOL_SECRET_VARIABLE: self.authkey.hex(), POOL_APP_PID_VARIABLE: str(self.app_pid or ""),
                POOL_SETTINGS_VARIABLE: self.settings.to_json()}

    @staticmethod
    def take_from_environment() -> PoolLaunch:
        """This rank's launch, removed from the environment, so no child of a rank (compiler workers) inherits the
        secret. A rank started by an operator on another node has none: its own host's settings then."""
        authkey = bytes.fromhex(os.environ.pop(POOL_SECRET_VARIABLE, ""))
        app_pid = os.environ.pop(POOL_APP_PID_VARIABLE, "")
        given = os.environ.pop(POOL_SETTINGS_VARIABLE, "")
        return PoolLaunch(authkey, int(app_pid) if app_pid else None,
                          Settings.from_json(given) if given else Settings.from_env())
