"""The shared compile store: a fresh host's first image at a shape another host built and published, against a cold
compile (the first host's own first image), each in a fresh process with empty cache folders.

The store is moto's S3 server on loopback, reached through s3fs as a real bucket would be (a shared folder when moto
or s3fs is not installed). Run it with `python -m acceldemo bench --sections store`.
"""
from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

from .figures import Figure, Spread, Target, ratios
from .restart import _run_child, new_cache

SIZE = "64x64"
MODE = "compiled"


@contextlib.contextmanager
def bench_store(work: Path) -> Iterator[tuple[str, dict[str, str], str]]:
    """A store for the children: (URL without its per-pair prefix, their environment, what it is)."""
    try:
        import s3fs
        from moto.server import ThreadedMotoServer
    except ImportError as missing:
        yield str(work / "shared"), {}, f"a shared folder ({missing.name} is not installed: no S3 server)"
        return
    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        credentials = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                       "AWS_DEFAULT_REGION": "us-east-1"}
        options = {"client_kwargs": {"endpoint_url": f"http://{host}:{port}"}}
        s3fs.S3FileSystem(skip_instance_cache=True, key="bench", secret="bench", **options).makedirs(
            "bench", exist_ok=True)
        yield "s3://bench", {**credentials, "ACCELDEMO_ARTIFACTS_OPTIONS": json.dumps(options)}, \
            "moto's S3 server on loopback, through s3fs"
    finally:
        server.stop()


def measure_store(models_dir: Path, model: str, hardware: str, backend: str, pairs: int, log=print) -> list[Figure]:
    """`pairs` times: a cold host compiles SIZE and publishes it to an empty store prefix, then a fresh host (empty
    cache folders) draws its first image at SIZE from that prefix. Each pair's ratio: fresh ÷ cold."""
    work = Path(tempfile.mkdtemp(prefix="acceldemo-bench-store-"))
    cold, fresh = [], []
    try:
        def fresh_cache(name: str) -> Path:
            return new_cache(work, name, models_dir)

        with bench_store(work) as (base, env, what):
            for i in range(pairs):
                store = {**env, "ACCELDEMO_ARTIFACTS": f"{base}/{uuid.uuid4().hex[:8]}"}
                cold.append(_run_child(fresh_cache(f"cold{i}"), model, hardware, MODE, backend, SIZE, "auto", store))
                log(f"  cold host {cold[-1]['first_image_s']:.1f} s to its first image (compiled and published)")
                fresh.append(_run_child(fresh_cache(f"fresh{i}"), model, hardware, MODE, backend, SIZE, "auto", store))
                log(f"  fresh host {fresh[-1]['first_image_s']:.1f} s ({fresh[-1]['packages_fetched']} package "
                    f"fetched, {fresh[-1]['new_graphs']} graphs compiled)")
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def spread(runs: list[dict], field: str) -> dict:
        return Spread.of(r[field] for r in runs).__dict__

    detail = {"store": what, "backend": backend, "mode": MODE, "size": SIZE,
              **{f"{name}_{field}": spread(runs, field) for name, runs in (("cold", cold), ("fresh", fresh))
                 for field in ("first_image_s", "compile_s", "load_s", "process_s")},
              "fresh_packages_fetched": [r["packages_fetched"] for r in fresh],
              "fresh_new_graphs": [r["new_graphs"] for r in fresh]}
    fetched = min(detail["fresh_packages_fetched"]) > 0
    return [Figure(
        "store_fresh_host_vs_cold", 9, f"a fresh host's first image at a shape built elsewhere ÷ a cold compile "
        f"({MODE} {SIZE}, {backend})", "ratio", ratios([r["first_image_s"] for r in fresh],
                                                        [r["first_image_s"] for r in cold]),
        Target("<=", 0.15), note=f"after imports, fresh processes with empty cache folders; store: {what}",
        detail=detail,
        if_missed=("the fresh host fetched its package; what is left is loading the pipeline "
                   f"({detail['fresh_load_s']['median']:.1f} s) and the download" if fetched else
                   "the fresh host found no package in the store and compiled: see the store's log lines"))]
