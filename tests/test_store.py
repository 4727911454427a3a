"""The shared artifact store (ACCELDEMO_ARTIFACTS): a real S3 protocol (moto's server, through s3fs) and a shared
folder. A host that compiled a shape publishes its package; a fresh host loads it instead of compiling; what fails
its checksum or lacks its manifest is refused and rebuilt; a store that goes away never fails a request.

The AOTInductor builds (20-80 s each here) are few: one package, built once by "app A", is what every other test
publishes, corrupts or fetches; only the refusal and outage tests build again, as a real host would.
"""
import contextlib
import dataclasses
import json
import logging
import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import numpy as np
import pytest

from acceldemo.config import Settings
from acceldemo.executors.artifacts import ArtifactStore
from acceldemo.executors.remote import MANIFEST, FetchOutcome, RemoteArtifacts
from acceldemo.records import GenerateParams
from tests.engines import new_manager, s3_server, serving

ROOT = Path(__file__).resolve().parents[1]
SHAPE = "64x64"
# The app's default model (the embedded trained one), in the mode whose packages the store carries on CPU.
REQUEST = dict(prompt="a red circle", model="tiny-shapes", hardware="cpu", mode="compiled", resolution=SHAPE,
               steps=2, seed=1)


def host(tmp: Path, url: str | None = None, options: dict | None = None, **overrides):
    """An engine as one host of a fleet builds it: its own (empty) cache folder, inductor, the store."""
    return new_manager(cache_dir=tmp, cpu_compile_backend="inductor", precompile="auto", artifacts=url,
                       artifacts_options=options or {}, **overrides)


def fresh_prefix() -> str:
    return f"s3://fleet/{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def published(s3, tmp_path_factory):
    """App A: compiles 64x64 once and publishes the package to the S3 store; its local package and the store."""
    url = fresh_prefix()
    cache = tmp_path_factory.mktemp("host-a")
    engine = host(cache, url, s3)
    try:
        result = engine.generate(GenerateParams(**REQUEST))
        counts = engine.artifacts.counts()
    finally:
        engine.close()
    assert (result.new_graphs, counts["built"], counts["published"], counts["store_failed"]) == (1, 1, 1, 0)
    [package] = ArtifactStore(cache / "aoti").packages()
    return {"url": url, "options": s3, "cache": cache, "package": Path(package["path"])}


def first_image(engine):
    result = engine.generate(GenerateParams(**REQUEST))
    image = np.asarray(result.images[0])
    assert image.shape[:2] == (64, 64) and image.std() > 0
    return result


def publish_copy(package: Path, url: str, options: dict | None = None) -> RemoteArtifacts:
    """Publish app A's package to another store, as its build would have."""
    store = ArtifactStore(package.parents[2], RemoteArtifacts(url, options))
    assert store.publish(package)
    return store.remote


# --- a fresh host, served by another's compile -------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.inductor
def test_a_fresh_host_serves_its_first_image_from_the_s3_store_without_compiling(published, tmp_path):
    engine = host(tmp_path, published["url"], published["options"])
    try:
        result = first_image(engine)
        assert (result.compile_cache_hits, result.new_graphs) == (1, 0)
        counts = engine.artifacts.counts()
        assert (counts["fetched"], counts["loaded"], counts["built"], counts["rejected"]) == (1, 1, 0, 0)
        status = engine.snapshot().artifacts_store
        assert status["reachable"] and status["fetched"] == 1 and status["url"] == published["url"]
    finally:
        engine.close()
    [package] = ArtifactStore(tmp_path / "aoti").packages()  # now in its own folder too, with its facts
    assert package["shape"] == SHAPE and package["path"].endswith(published["package"].name)


@pytest.mark.slow
@pytest.mark.inductor
def test_warmup_push_fills_a_shared_folder_and_a_fresh_host_serves_from_it(published, tmp_path):
    folder = tmp_path / "shared"
    env = {**os.environ, "ACCELDEMO_CACHE_DIR": str(published["cache"]), "ACCELDEMO_CPU_COMPILE_BACKEND": "inductor"}
    done = subprocess.run([sys.executable, "-m", "acceldemo", "warmup", "--model", "tiny-shapes", "--hardware", "cpu",
                           "--mode", "compiled", "--size", SHAPE, "--push", "--artifacts", str(folder), "--json"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    pushed = json.loads(done.stdout.strip().splitlines()[-1])
    assert pushed["pushed"] == [str(published["package"])] and pushed["store_error"] is None
    assert len(list(folder.rglob("*" + MANIFEST))) == 1

    engine = host(tmp_path / "host-b", str(folder))
    try:
        result = first_image(engine)
        assert (result.compile_cache_hits, result.new_graphs) == (1, 0)
    finally:
        engine.close()

    listed = subprocess.run([sys.executable, "-m", "acceldemo", "cache", "--verify", "--json", "--artifacts",
                             str(folder)], cwd=ROOT, env={**env, "ACCELDEMO_CACHE_DIR": str(tmp_path / "empty")},
                            capture_output=True, text=True, timeout=120)
    [artifact] = json.loads(listed.stdout)["store"]["artifacts"]
    assert artifact["problem"] is None and artifact["about"]["shape"] == SHAPE and listed.returncode == 0


# --- refused, and rebuilt --------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.inductor
def test_a_half_written_upload_is_refused_and_rebuilt(published, tmp_path):
    folder = tmp_path / "shared"
    publish_copy(published["package"], str(folder))
    [manifest] = folder.rglob("*" + MANIFEST)
    manifest.unlink()  # the upload stopped after the package, before its manifest

    engine = host(tmp_path / "host-d", str(folder))
    try:
        first_image(engine)
        counts = engine.artifacts.counts()
        assert (counts["rejected"], counts["built"], counts["published"]) == (1, 1, 1)
    finally:
        engine.close()
    assert manifest.exists()
    fetched = RemoteArtifacts(str(folder)).fetch(published_name(folder), tmp_path / "check.pt2")
    assert fetched.outcome is FetchOutcome.HIT  # one valid artifact again


def published_name(folder: Path) -> str:
    [manifest] = folder.rglob("*" + MANIFEST)
    return manifest.relative_to(folder).as_posix()[:-len(MANIFEST)]


@pytest.mark.slow
@pytest.mark.inductor
def test_a_flipped_byte_is_refused_and_with_the_store_taken_down_mid_request_requests_are_served(aws_credentials,
                                                                                                 published, tmp_path):
    """One rebuild shows both: the store's copy fails its checksum, and while this host compiles for itself the
    store goes away (moto stopped), so its publication fails. Requests are served; /status, /metrics and the page
    show the outage."""
    import httpx
    import openai

    from acceldemo.records import Phase
    from acceldemo.ui.page import describe_packages
    from acceldemo.ui.server import create_app

    with s3_server() as (server, options):
        url = fresh_prefix()
        remote = publish_copy(published["package"], url, options)
        fs, root = remote.filesystem()
        [obj] = [path for path in fs.find(root) if not path.endswith(MANIFEST)]
        data = bytearray(fs.cat_file(obj))
        data[len(data) // 2] ^= 0x01
        fs.pipe_file(obj, bytes(data))

        engine = host(tmp_path / "host-c", url, options)
        with serving(create_app(engine)) as app:
            assert engine.artifacts.remote.check()
            assert httpx.get(app + "/status").json()["artifacts_store"]["reachable"] is True

            def take_the_store_down(event):
                if event.phase is Phase.COMPILE and "ahead of time" in event.message:
                    server.stop()

            result = engine.generate(GenerateParams(**REQUEST), take_the_store_down)
            assert np.asarray(result.images[0]).shape[:2] == (64, 64) and result.new_graphs == 1
            client = openai.OpenAI(base_url=app + "/v1", api_key="unused", max_retries=0, timeout=300)
            answer = client.images.generate(prompt="a blue square", size=SHAPE, model="tiny-shapes",
                                            extra_body={"mode": "compiled", "seed": 2, "num_inference_steps": 2})
            assert answer.data[0].b64_json or answer.data[0].url

            status = httpx.get(app + "/status").json()
            store = status["artifacts_store"]
            assert (store["rejected"], store["published"], store["store_failed"]) == (1, 0, 1)
            assert store["reachable"] is False and "Could not connect" in store["error"]
            assert status["precompiled"]["built"] == 1
            assert status["counters"]["requests"]["ok"] == 2 and status["counters"]["requests"]["failed"] == 0
            metrics = httpx.get(app + "/metrics").text
            assert "acceldemo_artifact_store_up 0.0" in metrics
            assert 'acceldemo_precompiled_packages{event="rejected"} 1.0' in metrics
            assert "unreachable" in describe_packages(status["precompiled"])


# --- the store's own rules, without a compile ----------------------------------------------------------------------

def test_two_hosts_publishing_one_key_at_once_both_succeed_and_one_valid_artifact_remains(s3, tmp_path):
    for url, options in ((fresh_prefix(), s3), (str(tmp_path / "shared"), {})):
        sources = []
        for i in range(2):
            sources.append(tmp_path / f"build-{i}.pt2")
            sources[-1].write_bytes(bytes([i]) * 200_000)  # two builds of one key need not be byte-identical
        hosts = [RemoteArtifacts(url, options) for _ in sources]
        start, answers = threading.Barrier(2), [None, None]

        def publish(i):
            start.wait()
            answers[i] = hosts[i].publish("aoti/m/cpu/key", sources[i], {"host": i}, ".pt2")

        threads = [threading.Thread(target=publish, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert answers == [True, True]
        target = tmp_path / "fetched.pt2"
        fetched = RemoteArtifacts(url, options).fetch("aoti/m/cpu/key", target)
        assert fetched.outcome is FetchOutcome.HIT
        assert target.read_bytes() == sources[fetched.about["host"]].read_bytes()
        target.unlink()


def test_a_read_refuses_what_does_not_match_its_manifest(tmp_path):
    remote, target = RemoteArtifacts(str(tmp_path / "store")), tmp_path / "local" / "p.pt2"
    assert remote.fetch("aoti/m/cpu/k", target).outcome is FetchOutcome.MISS
    source = tmp_path / "p.pt2"
    source.write_bytes(b"package bytes")
    assert remote.publish("aoti/m/cpu/k", source, {"shape": "64x64"}, ".pt2")
    manifest = tmp_path / "store" / "aoti" / "m" / "cpu" / ("k" + MANIFEST)
    facts = json.loads(manifest.read_text())
    stored = tmp_path / "store" / facts["object"]

    stored.write_bytes(b"package bytez")  # same size, other bytes
    refused = remote.fetch("aoti/m/cpu/k", target)
    assert refused.outcome is FetchOutcome.REJECTED and "sha256" in refused.why and not target.exists()
    stored.write_bytes(b"package")  # cut short
    assert remote.fetch("aoti/m/cpu/k", target).outcome is FetchOutcome.REJECTED
    manifest.write_text(manifest.read_text()[:20])  # a manifest cut short
    assert remote.fetch("aoti/m/cpu/k", target).outcome is FetchOutcome.REJECTED
    manifest.unlink()
    assert "without its manifest" in remote.fetch("aoti/m/cpu/k", target).why
    stored.write_bytes(b"package bytes")
    manifest.write_text(json.dumps(facts))
    assert remote.fetch("aoti/m/cpu/k", target).about == {"shape": "64x64"} and target.read_bytes() == b"package bytes"
    assert not list(target.parent.glob(".fetch-*")) and remote.events["rejected"] == 4


def test_an_unreachable_store_is_reported_once_and_left_alone_for_a_while(aws_credentials, tmp_path, caplog):
    from acceldemo.ui.page import describe_store

    options = {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9"},  # discard port: connection refused
               "config_kwargs": {"connect_timeout": 1, "retries": {"max_attempts": 1}}}
    remote = RemoteArtifacts("s3://fleet/down", options)
    source = tmp_path / "p.pt2"
    source.write_bytes(b"x")
    with caplog.at_level(logging.WARNING, logger="acceldemo.artifacts"):
        assert remote.check() is False
        assert remote.fetch("aoti/m/cpu/k", tmp_path / "t.pt2").outcome is FetchOutcome.UNAVAILABLE
        assert remote.publish("aoti/m/cpu/k", source, {}) is False
    assert len([r for r in caplog.records if "cannot be used" in r.message]) == 1
    report = remote.report()
    assert report["reachable"] is False and "Could not connect" in report["error"] and report["since"]
    assert remote.events["store_failed"] == 1  # the later two did not try: the store is left alone for a while
    assert "unreachable" in describe_store(report)


def test_the_store_url_must_be_a_protocol_fsspec_knows_or_a_path(tmp_path):
    assert Settings.from_env({"ACCELDEMO_ARTIFACTS": "s3://bucket/prefix"}).artifacts == "s3://bucket/prefix"
    assert Settings.from_env({"ACCELDEMO_ARTIFACTS": str(tmp_path)}).artifacts == str(tmp_path)
    assert Settings.from_env({}).artifacts is None
    with pytest.raises(ValueError, match=r"ACCELDEMO_ARTIFACTS='ftps3://x' is not accepted: ftps3:// is not a storage"):
        Settings.from_env({"ACCELDEMO_ARTIFACTS": "ftps3://x"})
    with pytest.raises(ValueError, match="ACCELDEMO_ARTIFACTS_OPTIONS=.*a JSON object, e.g."):
        Settings.from_env({"ACCELDEMO_ARTIFACTS_OPTIONS": "[1]"})
    settings = Settings.from_env({"ACCELDEMO_ARTIFACTS": "hf://datasets/org/name",
                                  "ACCELDEMO_ARTIFACTS_OPTIONS": '{"token": "x"}'})
    assert Settings.from_json(settings.to_json()) == settings  # handed to worker processes as it is


def test_a_missing_storage_client_is_named_with_what_to_install():
    with pytest.raises(ImportError, match=r"needs gcsfs: pip install gcsfs"):
        RemoteArtifacts("gs://bucket/prefix").filesystem()


def test_no_request_can_name_a_store():
    fields = {field.name for field in dataclasses.fields(GenerateParams)}
    assert not {name for name in fields if "store" in name or "artifact" in name or "url" in name}


def test_the_package_key_holds_weights_placement_generation_and_toolchain(tmp_path):
    from acceldemo.executors.artifacts import PrecompiledTransformer, weights_fingerprint
    from acceldemo.hardware import HardwareRegistry
    from acceldemo.models.catalog import CATALOG
    from acceldemo.models.loading import load_pipeline

    settings = Settings.from_env()
    pipe = load_pipeline(CATALOG["tiny-shapes"], settings)
    scope = PrecompiledTransformer(pipe.transformer, ArtifactStore(tmp_path), "tiny-shapes",
                                   HardwareRegistry(settings).get("cpu")).scope
    assert {"model", "weights", "config", "placement", "tp_size", "hardware", "generation", "toolchain",
            "code"} <= set(scope)
    assert scope["toolchain"].startswith("torch ") and scope["placement"] == "device" and scope["tp_size"] == 1
    # The same model kept elsewhere on another host has the same key (its files' path is no part of it).
    elsewhere = dataclasses.replace(settings, cache_dir=tmp_path / "other-host")
    tiny = [PrecompiledTransformer(load_pipeline(CATALOG["tiny-flux2-klein"], chosen).transformer,
                                   ArtifactStore(tmp_path), "tiny-flux2-klein", HardwareRegistry(chosen).get("cpu"))
            for chosen in (settings, elsewhere)]
    assert tiny[0].scope == tiny[1].scope
    before = weights_fingerprint(pipe.transformer)
    assert before == scope["weights"] and before.startswith("sha256 ")
    import torch

    with torch.no_grad():
        next(pipe.transformer.parameters()).view(-1)[0] += 1.0
    assert weights_fingerprint(pipe.transformer) != before


def test_neuron_reads_the_store_itself_and_tpu_keeps_its_cache_folder_in_step(tmp_path, monkeypatch):
    from acceldemo.hardware import HardwareRegistry
    from acceldemo.hardware.neuron import NeuronHardware

    assert NeuronHardware.store_env("s3://bucket/cache/") == {"NEURON_COMPILE_CACHE_URL": "s3://bucket/cache/neuron"}
    assert NeuronHardware.store_env("/mnt/shared") == {"NEURON_COMPILE_CACHE_URL": "/mnt/shared/neuron"}
    assert NeuronHardware.store_env("hf://datasets/org/name") == {}

    tpu = HardwareRegistry(Settings.from_env()).get("tpu")
    assert tpu.synced_cache_env == "TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT"
    monkeypatch.setattr(tpu, "toolchain", lambda: "torch 2.13, torch-tpu 0.2.0, libtpu 0.0.40")
    monkeypatch.setattr(tpu, "detect", lambda: _available("TPU v6e"))
    store = str(tmp_path / "store")
    built_here, fresh = tmp_path / "host-1", tmp_path / "host-2"
    (built_here / "programs").mkdir(parents=True)
    (built_here / "programs" / "a.bin").write_bytes(b"compiled program")
    monkeypatch.setenv("TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT", str(built_here))
    assert ArtifactStore(tmp_path / "a", RemoteArtifacts(store)).sync_compiler_cache(tpu, push=True) == 1
    assert ArtifactStore(tmp_path / "a", RemoteArtifacts(store)).sync_compiler_cache(tpu, push=True) == 0
    monkeypatch.setenv("TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT", str(fresh))
    assert ArtifactStore(tmp_path / "b", RemoteArtifacts(store)).sync_compiler_cache(tpu, push=False) == 1
    assert (fresh / "programs" / "a.bin").read_bytes() == b"compiled program"


def _available(generation: str):
    from acceldemo.hardware.base import Availability

    return Availability(True, "simulated", 4, 0, generation)


def test_cache_lists_verifies_and_prunes_the_store(tmp_path, capsys):
    from acceldemo import cli

    folder = tmp_path / "shared"
    remote = RemoteArtifacts(str(folder))
    good, bad = tmp_path / "good.pt2", tmp_path / "bad.pt2"
    good.write_bytes(b"good package")
    bad.write_bytes(b"bad package")
    about = {"model": "m", "hardware": "cpu", "shape": "64x64", "toolchain": "torch x"}
    assert remote.publish("aoti/m/cpu/good", good, about, ".pt2")
    assert remote.publish("aoti/m/cpu/bad", bad, about, ".pt2")
    [bad_object] = folder.rglob("bad.*.pt2")
    bad_object.write_bytes(b"bad packagf")
    (folder / "aoti" / "m" / "cpu" / "cut.0123456789abcdef.pt2").write_bytes(b"half")

    env = {"ACCELDEMO_CACHE_DIR": str(tmp_path / "cache")}
    with _environment(env):
        assert cli.main(["cache", "--artifacts", str(folder), "--json"]) == 0
    listed = {e["name"]: e for e in json.loads(capsys.readouterr().out)["store"]["artifacts"]}
    assert listed["aoti/m/cpu/bad"]["problem"] is None  # not downloaded without --verify
    assert "without a manifest" in listed["aoti/m/cpu/cut.0123456789abcdef.pt2"]["problem"]

    with _environment(env):
        assert cli.main(["cache", "--artifacts", str(folder), "--verify", "--prune", "--grace", "0", "--json"]) == 0
    shared = json.loads(capsys.readouterr().out)["store"]
    assert "sha256" in {e["name"]: e for e in shared["artifacts"]}["aoti/m/cpu/bad"]["problem"]
    assert len(shared["removed"]) == 3  # the bad one's manifest and object, the orphan
    left = RemoteArtifacts(str(folder)).entries()
    assert [e["name"] for e in left] == ["aoti/m/cpu/good"]


@contextlib.contextmanager
def _environment(values: dict):
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
