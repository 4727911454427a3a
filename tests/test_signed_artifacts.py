"""Signed packages in the shared artifact store (ACCELDEMO_ARTIFACTS_SIGNING_KEY, ACCELDEMO_ARTIFACTS_TRUST): a
publisher signs every manifest with its Ed25519 key; with a trust file set, a host loads only what a listed key
signed, and compiles the rest itself. On a shared folder and on a real S3 protocol (moto's server).

The refusals are shown on small fake packages (no compile); the two things only a real package can show — a
correctly signed one loads with no new graph, a tampered one is compiled here and still draws the right image — run
end to end on the default model, on one AOTInductor build shared by the slow tests plus one rebuild per store.
"""
import base64
import hashlib
import json
import logging
import uuid
from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519, rsa
from prometheus_client import generate_latest

from acceldemo import cli
from acceldemo.config import Settings
from acceldemo.executors.artifacts import ArtifactStore
from acceldemo.executors.remote import MANIFEST, NO_TRUST, FetchOutcome, Refusal, RemoteArtifacts
from acceldemo.executors.signing import Signer, Trust, signed_bytes
from tests.engines import new_manager
from tests.test_store import first_image, fresh_prefix, host

NAME = "aoti/m/cpu/key"
ABOUT = {"model": "m", "hardware": "cpu", "shape": "64x64", "placement": "device", "toolchain": "torch x"}


# --- keys, as an operator makes them with openssl ------------------------------------------------------------------

def private_key_file(folder: Path, name: str = "signing") -> Path:
    """An Ed25519 private key in a PEM (PKCS8) file, as `openssl genpkey -algorithm ed25519` writes it."""
    path = folder / f"{name}.pem"
    path.write_bytes(ed25519.Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return path


def public_pem(private: Path) -> bytes:
    """What `openssl pkey -in KEY -pubout` prints."""
    key = serialization.load_pem_private_key(private.read_bytes(), password=None)
    return key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def trust_file(folder: Path, *privates: Path) -> Path:
    path = folder / "trusted.pem"
    path.write_bytes(b"".join(public_pem(private) for private in privates))
    return path


@pytest.fixture
def keys(tmp_path):
    """A publisher's key, a key nobody trusts, and a trust file listing only the first (and an unrelated key)."""
    (folder := tmp_path / "keys").mkdir()
    ours, theirs, another = (private_key_file(folder, name) for name in ("ours", "theirs", "another"))
    trust = trust_file(folder, another, ours)
    return {"signer": Signer.from_file(ours), "stranger": Signer.from_file(theirs), "ours": ours,
            "trust_path": trust, "trust": Trust.from_file(trust)}


@pytest.fixture(params=["folder", "s3"])
def store(request, tmp_path):
    """A fresh store: a shared folder, or a prefix of moto's S3 bucket; (url, fsspec options)."""
    if request.param == "folder":
        return str(tmp_path / "shared"), {}
    return fresh_prefix(), request.getfixturevalue("s3")


def fake_package(tmp_path: Path, content: bytes = b"native code, as a publisher built it") -> Path:
    path = tmp_path / f"{uuid.uuid4().hex[:6]}.pt2"
    path.write_bytes(content)
    return path


def rewrite(remote: RemoteArtifacts, name: str, change) -> None:
    """Change NAME's manifest in the store as someone with write access could: `change(manifest, fs, root)`."""
    fs, root = remote.filesystem()
    manifest = json.loads(fs.cat_file(f"{root}/{name}{MANIFEST}"))
    change(manifest, fs, root)
    fs.pipe_file(f"{root}/{name}{MANIFEST}", json.dumps(manifest).encode())


def tamper(remote: RemoteArtifacts, name: str) -> None:
    """Replace NAME's object with other bytes and recompute its manifest's checksum and size to match them."""
    def change(manifest, fs, root):
        data = bytearray(fs.cat_file(f"{root}/{manifest['object']}"))
        data[len(data) // 2] ^= 0x01
        fs.pipe_file(f"{root}/{manifest['object']}", bytes(data))
        manifest["sha256"], manifest["bytes"] = hashlib.sha256(data).hexdigest(), len(data)

    rewrite(remote, name, change)


# --- what is signed -------------------------------------------------------------------------------------------------

def test_a_published_manifest_carries_an_ed25519_signature_of_its_content_by_a_named_key(keys, tmp_path):
    folder = tmp_path / "shared"
    assert RemoteArtifacts(str(folder), signer=keys["signer"]).publish(NAME, fake_package(tmp_path), ABOUT, ".pt2")
    manifest = json.loads((folder / (NAME + MANIFEST)).read_text())
    public = serialization.load_pem_public_key(public_pem(keys["ours"]))
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    assert manifest["signed_by"] == hashlib.sha256(raw).hexdigest()[:16] == keys["signer"].key_id
    signature = base64.b64decode(manifest["signature"], validate=True)
    assert len(signature) == 64
    public.verify(signature, signed_bytes(NAME, manifest))  # raises if it does not verify
    signed = json.loads(signed_bytes(NAME, manifest).split(b"\n", 1)[1])
    assert signed["about"] == ABOUT and {"name", "object", "sha256", "bytes"} <= set(signed)
    assert "signature" not in signed and "signed_by" not in signed


# --- refused or loaded, on a folder and on S3 ------------------------------------------------------------------------

def reader(store, keys) -> RemoteArtifacts:
    url, options = store
    return RemoteArtifacts(url, options, trust=keys["trust"])


def test_a_changed_object_with_its_checksum_recomputed_is_refused_as_bad_signature(store, keys, tmp_path, caplog):
    url, options = store
    publisher = RemoteArtifacts(url, options, signer=keys["signer"])
    assert publisher.publish(NAME, fake_package(tmp_path), ABOUT, ".pt2")
    tamper(publisher, NAME)
    assert RemoteArtifacts(url, options).fetch(NAME, tmp_path / "no-trust.pt2").outcome is FetchOutcome.HIT

    checked, target = reader(store, keys), tmp_path / "local" / "p.pt2"
    with caplog.at_level(logging.WARNING, logger="acceldemo.artifacts"):
        refused = checked.fetch(NAME, target)
    assert (refused.outcome, refused.reason) == (FetchOutcome.REJECTED, Refusal.BAD_SIGNATURE)
    assert refused.why.startswith("bad_signature: ") and "does not match the manifest" in refused.why
    assert not target.exists() and not list(target.parent.glob(".fetch-*"))
    assert any("bad_signature" in record.message and NAME in record.message for record in caplog.records)
    report = checked.report()
    assert report["rejected"] == 1 and report["rejections"]["bad_signature"] == 1


def test_an_unsigned_package_is_refused_when_trust_is_set(store, keys, tmp_path):
    url, options = store
    assert RemoteArtifacts(url, options).publish(NAME, fake_package(tmp_path), ABOUT, ".pt2")
    refused = reader(store, keys).fetch(NAME, tmp_path / "p.pt2")
    assert (refused.outcome, refused.reason) == (FetchOutcome.REJECTED, Refusal.UNSIGNED)
    assert "no signature" in refused.why and not (tmp_path / "p.pt2").exists()


def test_a_package_signed_by_an_untrusted_key_is_refused(store, keys, tmp_path):
    url, options = store
    assert RemoteArtifacts(url, options, signer=keys["stranger"]).publish(NAME, fake_package(tmp_path), ABOUT, ".pt2")
    refused = reader(store, keys).fetch(NAME, tmp_path / "p.pt2")
    assert (refused.outcome, refused.reason) == (FetchOutcome.REJECTED, Refusal.UNTRUSTED_KEY)
    assert keys["stranger"].key_id in refused.why and keys["signer"].key_id in refused.why  # who signed, who is trusted


def test_a_correctly_signed_package_is_fetched(store, keys, tmp_path):
    url, options = store
    package = fake_package(tmp_path)
    assert RemoteArtifacts(url, options, signer=keys["signer"]).publish(NAME, package, ABOUT, ".pt2")
    target = tmp_path / "local" / "p.pt2"
    fetched = reader(store, keys).fetch(NAME, target)
    assert fetched.outcome is FetchOutcome.HIT and fetched.about == ABOUT
    assert target.read_bytes() == package.read_bytes()


def test_a_signed_manifest_copied_to_another_name_is_refused(keys, tmp_path):
    """A package for one shape put where another shape's is looked for: the name is part of what is signed."""
    folder = tmp_path / "shared"
    assert RemoteArtifacts(str(folder), signer=keys["signer"]).publish(NAME, fake_package(tmp_path), ABOUT, ".pt2")
    (folder / ("aoti/m/cpu/other" + MANIFEST)).write_bytes((folder / (NAME + MANIFEST)).read_bytes())
    refused = RemoteArtifacts(str(folder), trust=keys["trust"]).fetch("aoti/m/cpu/other", tmp_path / "p.pt2")
    assert refused.reason is Refusal.BAD_SIGNATURE


def test_without_trust_any_package_loads_and_the_report_says_so(keys, tmp_path):
    folder = str(tmp_path / "shared")
    assert RemoteArtifacts(folder).publish(NAME, fake_package(tmp_path), ABOUT, ".pt2")
    plain = RemoteArtifacts(folder)
    assert plain.fetch(NAME, tmp_path / "p.pt2").outcome is FetchOutcome.HIT
    assert plain.report()["trust_warning"] == NO_TRUST and plain.report()["trusted_keys"] is None
    checked = RemoteArtifacts(folder, signer=keys["signer"], trust=keys["trust"]).report()
    assert checked["trust_warning"] is None and keys["signer"].key_id in checked["trusted_keys"]
    assert checked["signing_key"] == keys["signer"].key_id


def test_a_push_signs_what_the_store_holds_unsigned(keys, tmp_path):
    """`warmup --push` with a signing key newly set re-publishes packages the store has with the same bytes."""
    folder = str(tmp_path / "shared")
    package = fake_package(tmp_path)
    assert RemoteArtifacts(folder).publish(NAME, package, ABOUT, ".pt2")
    assert RemoteArtifacts(folder).holds(NAME, package)
    signing = RemoteArtifacts(folder, signer=keys["signer"])
    assert not signing.holds(NAME, package)
    assert signing.publish(NAME, package, ABOUT, ".pt2") and signing.holds(NAME, package)
    assert RemoteArtifacts(folder, trust=keys["trust"]).fetch(NAME, tmp_path / "p.pt2").outcome is FetchOutcome.HIT


# --- the app: start-up warning, /status, /metrics, `cache --verify` ------------------------------------------------

def test_a_store_without_trust_warns_once_at_start_and_in_status(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="acceldemo.engine"):
        engine = new_manager(cache_dir=tmp_path / "cache", artifacts=str(tmp_path / "shared"))
    try:
        assert [r.levelno for r in caplog.records if NO_TRUST in r.message] == [logging.WARNING]
        assert engine.snapshot().artifacts_store["trust_warning"] == NO_TRUST
    finally:
        engine.close()


def test_with_trust_set_status_lists_the_keys_and_metrics_count_refusals_by_reason(keys, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="acceldemo.engine"):
        engine = new_manager(cache_dir=tmp_path / "cache", artifacts=str(tmp_path / "shared"),
                             artifacts_signing_key=keys["ours"], artifacts_trust=keys["trust_path"])
    try:
        assert not [r for r in caplog.records if NO_TRUST in r.message]
        status = engine.snapshot().artifacts_store
        assert status["trust_warning"] is None and status["signing_key"] == keys["signer"].key_id
        assert len(status["trusted_keys"]) == 2 and status["rejections"]["bad_signature"] == 0
        engine.artifacts.record({"rejected": 1, "bad_signature": 1})  # what a call's package events bring
        metrics = generate_latest(engine.stats.registry).decode()
        assert 'acceldemo_artifact_rejections{reason="bad_signature"} 1.0' in metrics
        assert 'acceldemo_artifact_rejections{reason="untrusted_key"} 0.0' in metrics
    finally:
        engine.close()


def test_cache_verify_reports_each_package_signature_state(keys, tmp_path, capsys, monkeypatch):
    folder = tmp_path / "shared"
    for name, signer in (("trusted", keys["signer"]), ("stranger", keys["stranger"]), ("unsigned", None),
                         ("tampered", keys["signer"])):
        assert RemoteArtifacts(str(folder), signer=signer).publish(f"aoti/m/cpu/{name}", fake_package(tmp_path),
                                                                   ABOUT, ".pt2")
    tamper(RemoteArtifacts(str(folder)), "aoti/m/cpu/tampered")
    monkeypatch.setenv("ACCELDEMO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("ACCELDEMO_ARTIFACTS_TRUST", str(keys["trust_path"]))

    assert cli.main(["cache", "--artifacts", str(folder), "--verify", "--json"]) == 0
    listed = {e["name"].rpartition("/")[2]: e for e in json.loads(capsys.readouterr().out)["store"]["artifacts"]}
    states = {name: (e["signature_state"]["state"], e["signature_state"]["key_id"]) for name, e in listed.items()}
    assert states == {"trusted": ("trusted", keys["signer"].key_id), "stranger": ("untrusted_key", keys["stranger"].key_id),
                      "unsigned": ("unsigned", None), "tampered": ("bad_signature", keys["signer"].key_id)}
    assert listed["tampered"]["problem"].startswith("bad signature:")
    assert [name for name, e in listed.items() if e["problem"]] == ["tampered"]

    assert cli.main(["cache", "--artifacts", str(folder), "--verify"]) == 0
    text = capsys.readouterr().out
    assert f"signed by {keys['signer'].key_id} (trusted)" in text
    assert f"signed by {keys['stranger'].key_id} (not trusted)" in text and "unsigned" in text


# --- bad input: one clear line, never a traceback -------------------------------------------------------------------

def rsa_pem(public: bool = False) -> bytes:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    if public:
        return key.public_key().public_bytes(serialization.Encoding.PEM,
                                             serialization.PublicFormat.SubjectPublicKeyInfo)
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def refusal_at_start(variable: str, path: Path, tmp_path, capsys, monkeypatch) -> str:
    """What `cache` (an entry point, as serve and warmup are) says about one setting: its one line on stderr."""
    monkeypatch.setenv("ACCELDEMO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv(variable, str(path))
    assert cli.main(["cache", "--artifacts", str(tmp_path / "shared")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"error: {variable}={str(path)!r} is not accepted: ")
    return err


@pytest.mark.parametrize(("content", "said"), [
    (None, "no such file"),
    (b"this is not a key\n", "not a PEM private key"),
    ("rsa", "it is an RSA key; packages are signed with Ed25519 only"),
    ("public", "it holds a public key; the signing key is the private one"),
], ids=["missing", "not-pem", "rsa", "public-key"])
def test_a_signing_key_that_cannot_be_used_is_refused_at_start(content, said, keys, tmp_path, capsys, monkeypatch):
    path = tmp_path / "key.pem"
    if content == "rsa":
        path.write_bytes(rsa_pem())
    elif content == "public":
        path.write_bytes(public_pem(keys["ours"]))
    elif content is not None:
        path.write_bytes(content)
    assert said in refusal_at_start("ACCELDEMO_ARTIFACTS_SIGNING_KEY", path, tmp_path, capsys, monkeypatch)


@pytest.mark.parametrize(("content", "said"), [
    (b"", "it holds no PEM public key (it is empty)"),
    (b"ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIJ test@host\n", "it holds no PEM public key"),
    (b"-----BEGIN PUBLIC KEY-----\nbm90IGEga2V5\n-----END PUBLIC KEY-----\n", "its key 1 is not a valid PEM public key"),
    ("private", "it holds a private key, which must never leave the publisher"),
    ("rsa", "its key 2 is an RSA key; only Ed25519 keys are trusted"),
], ids=["empty", "not-a-key", "broken-pem", "private-key", "rsa"])
def test_a_trust_file_that_cannot_be_used_is_refused_at_start(content, said, keys, tmp_path, capsys, monkeypatch):
    path = tmp_path / "trusted.pem"
    if content == "private":
        path.write_bytes(keys["ours"].read_bytes())
    elif content == "rsa":
        path.write_bytes(public_pem(keys["ours"]) + rsa_pem(public=True))
    else:
        path.write_bytes(content)
    assert said in refusal_at_start("ACCELDEMO_ARTIFACTS_TRUST", path, tmp_path, capsys, monkeypatch)


def test_the_settings_are_paths_handed_to_worker_processes_as_they_are(keys):
    settings = Settings.from_env({"ACCELDEMO_ARTIFACTS_SIGNING_KEY": str(keys["ours"]),
                                  "ACCELDEMO_ARTIFACTS_TRUST": str(keys["trust_path"])})
    assert (settings.artifacts_signing_key, settings.artifacts_trust) == (keys["ours"], keys["trust_path"])
    assert Settings.from_json(settings.to_json()) == settings
    assert ArtifactStore.of(settings).remote is None  # checked (and usable) without a store too


def signature_of(remote: RemoteArtifacts, value) -> None:
    def change(manifest, fs, root):
        manifest["signature"] = value

    rewrite(remote, NAME, change)


@pytest.mark.parametrize(("signature", "said"), [
    (base64.b64encode(b"x" * 63).decode(), "its signature is 63 bytes; an Ed25519 signature is 64"),
    ("not base64 at all!", "its signature is not base64"),
    (12345, "its signature is 12345 (int), not base64 text"),
    (None, "its signature is None (NoneType), not base64 text"),
], ids=["wrong-length", "not-base64", "a-number", "null"])
def test_a_malformed_signature_is_refused_as_bad_signature_never_raised(signature, said, keys, tmp_path):
    folder = str(tmp_path / "shared")
    publisher = RemoteArtifacts(folder, signer=keys["signer"])
    assert publisher.publish(NAME, fake_package(tmp_path), ABOUT, ".pt2")
    signature_of(publisher, signature)
    refused = RemoteArtifacts(folder, trust=keys["trust"]).fetch(NAME, tmp_path / "p.pt2")
    assert (refused.outcome, refused.reason) == (FetchOutcome.REJECTED, Refusal.BAD_SIGNATURE)
    assert said in refused.why
    [entry] = RemoteArtifacts(folder).entries()  # `cache` lists it, without trust too, with the reason
    assert entry["signature_state"]["state"] == "bad_signature" and said in entry["signature_state"]["why"]


def test_a_signer_id_that_is_not_a_key_id_is_refused(keys, tmp_path):
    folder = str(tmp_path / "shared")
    publisher = RemoteArtifacts(folder, signer=keys["signer"])
    assert publisher.publish(NAME, fake_package(tmp_path), ABOUT, ".pt2")

    def change(manifest, fs, root):
        manifest["signed_by"] = ["../../etc/passwd"]

    rewrite(publisher, NAME, change)
    refused = RemoteArtifacts(folder, trust=keys["trust"]).fetch(NAME, tmp_path / "p.pt2")
    assert refused.reason is Refusal.BAD_SIGNATURE and "is not a key id" in refused.why


# --- end to end: a real package, built once ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def signed_build(tmp_path_factory):
    """App A, with a signing key: compiles 64x64 once and publishes the signed package to a shared folder."""
    folder = tmp_path_factory.mktemp("keys")
    ours, stranger = private_key_file(folder, "ours"), private_key_file(folder, "stranger")
    trust = trust_file(folder, ours)
    store, cache = tmp_path_factory.mktemp("signed-store"), tmp_path_factory.mktemp("host-a")
    engine = host(cache, str(store), artifacts_signing_key=ours)
    try:
        result = first_image(engine)
        counts = engine.artifacts.counts()
    finally:
        engine.close()
    assert (result.new_graphs, counts["built"], counts["published"]) == (1, 1, 1)
    [manifest] = store.rglob("*" + MANIFEST)
    assert json.loads(manifest.read_text())["signed_by"] == Signer.from_file(ours).key_id
    [package] = ArtifactStore(cache / "aoti").packages()
    return {"store": str(store), "package": Path(package["path"]), "ours": ours, "stranger": stranger,
            "trust": trust, "image": np.asarray(result.images[0], dtype=np.float32)}


def signed_copy(build: dict, store) -> RemoteArtifacts:
    """App A's package published, signed by its key, to a fresh store of this kind."""
    url, options = store
    if not options:  # the folder App A published to
        return RemoteArtifacts(build["store"])
    remote = RemoteArtifacts(url, options, signer=Signer.from_file(build["ours"]))
    assert ArtifactStore(build["package"].parents[2], remote).publish(build["package"])
    return remote


@pytest.mark.slow
@pytest.mark.inductor
def test_a_correctly_signed_package_loads_with_no_new_graph(signed_build, store, tmp_path):
    remote = signed_copy(signed_build, store)
    engine = host(tmp_path / "host-b", remote.url, remote.options, artifacts_trust=signed_build["trust"])
    try:
        result = first_image(engine)
        assert (result.new_graphs, result.compile_cache_hits) == (0, 1)
        counts = engine.artifacts.counts()
        assert (counts["fetched"], counts["loaded"], counts["built"], counts["rejected"]) == (1, 1, 0, 0)
        assert result.facts()["packages"] == {"fetched": 1, "loaded": 1}
    finally:
        engine.close()


@pytest.mark.slow
@pytest.mark.inductor
def test_a_tampered_package_is_refused_compiled_here_and_its_image_is_right(signed_build, store, tmp_path, caplog):
    url, options = store
    if not options:  # a folder of its own: the shared one stays intact for the other tests
        url = str(tmp_path / "shared")
    remote = RemoteArtifacts(url, options, signer=Signer.from_file(signed_build["ours"]))
    assert ArtifactStore(signed_build["package"].parents[2], remote).publish(signed_build["package"])
    [name] = [e["name"] for e in remote.entries() if not e.get("orphan")]
    tamper(remote, name)

    engine = host(tmp_path / "host-c", url, options, artifacts_trust=signed_build["trust"])
    try:
        with caplog.at_level(logging.WARNING, logger="acceldemo.artifacts"):
            result = first_image(engine)  # the right size, not constant
        assert result.new_graphs == 1 and result.facts()["packages"]["bad_signature"] == 1
        image = np.asarray(result.images[0], dtype=np.float32)
        assert np.abs(image - signed_build["image"]).mean() < 2.0  # what App A drew, compiled here
        counts = engine.artifacts.counts()
        assert (counts["rejected"], counts["built"], counts["fetched"]) == (1, 1, 0)
        assert engine.snapshot().artifacts_store["rejections"]["bad_signature"] == 1
        metrics = generate_latest(engine.stats.registry).decode()
        assert 'acceldemo_artifact_rejections{reason="bad_signature"} 1.0' in metrics
        assert any("bad_signature" in r.message and "does not match" in r.message for r in caplog.records)
    finally:
        engine.close()


def test_a_host_that_trusts_keys_but_cannot_sign_publishes_nothing(tmp_path, keys, caplog):
    folder = str(tmp_path / "store")
    assert RemoteArtifacts(folder, signer=keys["signer"]).publish(NAME, fake_package(tmp_path), ABOUT, ".pt2")
    signed = (tmp_path / "store" / (NAME + ".manifest.json")).read_text()
    checking = RemoteArtifacts(folder, trust=keys["trust"])
    with caplog.at_level(logging.WARNING, logger="acceldemo.artifacts"):
        assert not checking.publish(NAME, fake_package(tmp_path), ABOUT, ".pt2")
        assert not checking.publish(NAME, fake_package(tmp_path), ABOUT, ".pt2")
    assert (tmp_path / "store" / (NAME + ".manifest.json")).read_text() == signed  # the signed one stays
    assert caplog.text.count("packages compiled here stay here") == 1
    assert checking.fetch(NAME, tmp_path / "p.pt2").outcome is FetchOutcome.HIT


def test_the_operator_panel_says_which_keys_the_store_trusts_and_what_it_refused(tmp_path, keys):
    from acceldemo.ui.page import describe_store

    folder = str(tmp_path / "store")
    assert RemoteArtifacts(folder).publish(NAME, fake_package(tmp_path), ABOUT, ".pt2")
    checking = RemoteArtifacts(folder, trust=keys["trust"])
    assert checking.fetch(NAME, tmp_path / "p.pt2").outcome is FetchOutcome.REJECTED
    shown = describe_store(checking.report())
    assert "1 refused (1 unsigned)" in shown and f"signed by {', '.join(keys['trust'].key_ids)} only" in shown
    assert "no ACCELDEMO_ARTIFACTS_TRUST" in describe_store(RemoteArtifacts(folder).report())

