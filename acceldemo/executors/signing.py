"""Signed packages: a publisher's Ed25519 key signs every manifest it writes to the shared store, and loaders trust
only the public keys an operator lists (ACCELDEMO_ARTIFACTS_SIGNING_KEY, ACCELDEMO_ARTIFACTS_TRUST).

A checksum beside an object in the same store finds corruption; anyone who can write the store can change both.
The signature covers the manifest's whole content (the artifact's name, its object, checksum and size, and `about`:
model, shape, placement, hardware, compiler and library versions), so a changed object, a recomputed checksum or a
manifest copied to another name no longer verifies. It lives in the manifest itself (`signature`, `signed_by`): the
manifest is the one object a publication writes last and atomically, so a reader never sees a new manifest beside an
old signature, and listing, pruning and removal stay as they are.

`cryptography` (requirements-fleet.txt) is imported only when a key or a trust file is set.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

SIGNING_KEY_SETTING = "ACCELDEMO_ARTIFACTS_SIGNING_KEY"
TRUST_SETTING = "ACCELDEMO_ARTIFACTS_TRUST"
# The manifest's fields that carry its signature, and so are not part of what is signed.
SIGNATURE_FIELDS = ("signature", "signed_by")
# Signed bytes start with this, so a signature made for anything else by the same key never verifies as a manifest's.
_CONTEXT = b"acceldemo artifact manifest v1\n"
_SIGNATURE_BYTES = 64
_KEY_ID = re.compile(r"[0-9a-f]{16}")
_PUBLIC_PEM = re.compile(rb"-----BEGIN PUBLIC KEY-----.*?-----END PUBLIC KEY-----", re.S)
_MAKE_KEY = "make one with `openssl genpkey -algorithm ed25519 -out signing.pem`"
_MAKE_TRUST = "make it with `openssl pkey -in signing.pem -pubout >> trusted.pem`"


class SignatureState(StrEnum):
    """What a manifest's signature is: verified against a trusted key; well formed but not checked (no trust set);
    absent; malformed or not matching the manifest; or made by a key the trust file does not list."""

    TRUSTED = "trusted"
    SIGNED = "signed"
    UNSIGNED = "unsigned"
    BAD_SIGNATURE = "bad_signature"
    UNTRUSTED_KEY = "untrusted_key"


@dataclass(frozen=True)
class Verdict:
    state: SignatureState
    key_id: str | None = None
    why: str = ""

    def facts(self) -> dict:
        return {"state": str(self.state), "key_id": self.key_id, "why": self.why, "text": self.describe()}

    def describe(self) -> str:
        """One line for `cache`: who signed it and whether this host trusts that key."""
        if self.state is SignatureState.TRUSTED:
            return f"signed by {self.key_id} (trusted)"
        if self.state is SignatureState.SIGNED:
            return f"signed by {self.key_id} (not checked: no {TRUST_SETTING})"
        if self.state is SignatureState.UNTRUSTED_KEY:
            return f"signed by {self.key_id} (not trusted)"
        if self.state is SignatureState.UNSIGNED:
            return "unsigned"
        return f"bad signature: {self.why}"


def key_id(public_key) -> str:
    """A public key's short name: the first 16 hex digits of the sha256 of its 32 raw bytes."""
    from cryptography.hazmat.primitives import serialization

    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def signed_bytes(name: str, manifest: dict) -> bytes:
    """What is signed: the manifest without its signature fields, with the name it is published under, as canonical
    JSON (sorted keys, no spaces), after a context line."""
    body = {field: value for field, value in manifest.items() if field not in SIGNATURE_FIELDS} | {"name": name}
    return _CONTEXT + json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                                 allow_nan=False).encode()


def _read(path: Path, setting: str, wanted: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise ValueError(f"{setting}={str(path)!r} is not accepted: no such file; {wanted}") from None
    except OSError as error:
        raise ValueError(f"{setting}={str(path)!r} is not accepted: it cannot be read ({type(error).__name__}: "
                         f"{error.strerror or error}); {wanted}") from None


def _cryptography(setting: str):
    try:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError:
        raise ValueError(f"{setting} needs the cryptography package: pip install cryptography==51.0.1 (listed in "
                         "requirements-fleet.txt)") from None
    return serialization, ed25519


def _kind(key) -> str:
    return type(key).__name__.lstrip("_").removesuffix("PrivateKey").removesuffix("PublicKey")


@dataclass(frozen=True)
class Signer:
    """This host's signing key: every manifest it publishes carries a signature by it."""

    private_key: object
    key_id: str

    @classmethod
    def from_file(cls, path: Path, setting: str = SIGNING_KEY_SETTING) -> Signer:
        """The Ed25519 private key in a PEM (PKCS8) file, or a ValueError naming the setting and what is wrong."""
        wanted = f"a PEM (PKCS8) Ed25519 private key; {_MAKE_KEY}"
        data = _read(path, setting, wanted)
        serialization, ed25519 = _cryptography(setting)
        refused = f"{setting}={str(path)!r} is not accepted:"
        if b"PUBLIC KEY-----" in data and b"PRIVATE KEY-----" not in data:
            raise ValueError(f"{refused} it holds a public key; the signing key is the private one ({wanted})")
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except TypeError:  # cryptography's answer to an encrypted key without a password
            raise ValueError(f"{refused} the key is encrypted; give it unencrypted (readable by the app only): "
                             f"{wanted}") from None
        except Exception:  # ValueError, UnsupportedAlgorithm: not PEM, or a PEM of nothing it can read
            raise ValueError(f"{refused} it is not a PEM private key; {wanted}") from None
        if not isinstance(key, ed25519.Ed25519PrivateKey):
            raise ValueError(f"{refused} it is an {_kind(key)} key; packages are signed with Ed25519 only: "
                             f"{_MAKE_KEY}")
        return cls(key, key_id(key.public_key()))

    def sign(self, name: str, manifest: dict) -> dict:
        """The signature fields to add to NAME's manifest."""
        signature = self.private_key.sign(signed_bytes(name, manifest))
        return {"signature": base64.b64encode(signature).decode(), "signed_by": self.key_id}


@dataclass(frozen=True)
class Trust:
    """The public keys whose signatures this host accepts, by key id; where it comes from, for messages."""

    keys: dict
    source: str = TRUST_SETTING

    @classmethod
    def from_file(cls, path: Path, setting: str = TRUST_SETTING) -> Trust:
        """Every Ed25519 public key in one file of concatenated PEM blocks, or a ValueError naming the setting and
        what is wrong (nothing in it, a key that does not parse, another algorithm, a private key)."""
        wanted = f"a file of PEM Ed25519 public keys ('-----BEGIN PUBLIC KEY-----'), one or more; {_MAKE_TRUST}"
        data = _read(path, setting, wanted)
        serialization, ed25519 = _cryptography(setting)
        refused = f"{setting}={str(path)!r} is not accepted:"
        if b"PRIVATE KEY-----" in data:
            raise ValueError(f"{refused} it holds a private key, which must never leave the publisher; {wanted}")
        blocks = _PUBLIC_PEM.findall(data)
        if not blocks:
            raise ValueError(f"{refused} it holds no PEM public key{' (it is empty)' if not data.strip() else ''}; "
                             f"{wanted}")
        keys = {}
        for number, block in enumerate(blocks, 1):
            try:
                key = serialization.load_pem_public_key(block)
            except Exception:
                raise ValueError(f"{refused} its key {number} is not a valid PEM public key; {wanted}") from None
            if not isinstance(key, ed25519.Ed25519PublicKey):
                raise ValueError(f"{refused} its key {number} is an {_kind(key)} key; only Ed25519 keys are "
                                 f"trusted; {wanted}")
            keys[key_id(key)] = key
        return cls(keys, f"{setting}={str(path)!r}")

    @property
    def key_ids(self) -> list[str]:
        return sorted(self.keys)


def check(name: str, manifest: dict, trust: Trust | None) -> Verdict:
    """Whether NAME's manifest is signed, and (with `trust`) by a trusted key over exactly this content. Never
    raises: whatever the manifest holds, the answer is a verdict with the reason in words."""
    signature, signer = manifest.get("signature"), manifest.get("signed_by")
    if signature is None and signer is None:
        return Verdict(SignatureState.UNSIGNED, why=f"no signature (published without {SIGNING_KEY_SETTING})")
    if not isinstance(signer, str) or not _KEY_ID.fullmatch(signer):
        return Verdict(SignatureState.BAD_SIGNATURE, why=f"its signed_by {_shown(signer)} is not a key id (16 hex "
                                                         "digits)")
    if not isinstance(signature, str):
        return Verdict(SignatureState.BAD_SIGNATURE, signer, f"its signature is {_shown(signature)}, not base64 text")
    try:
        raw = base64.b64decode(signature, validate=True)
    except (binascii.Error, ValueError):
        return Verdict(SignatureState.BAD_SIGNATURE, signer, "its signature is not base64")
    if len(raw) != _SIGNATURE_BYTES:
        return Verdict(SignatureState.BAD_SIGNATURE, signer,
                       f"its signature is {len(raw)} bytes; an Ed25519 signature is {_SIGNATURE_BYTES}")
    if trust is None:
        return Verdict(SignatureState.SIGNED, signer)
    key = trust.keys.get(signer)
    if key is None:
        return Verdict(SignatureState.UNTRUSTED_KEY, signer,
                       f"signed by key {signer}, which {trust.source} does not list (it lists "
                       f"{', '.join(trust.key_ids)})")
    from cryptography.exceptions import InvalidSignature

    try:
        key.verify(raw, signed_bytes(name, manifest))
    except InvalidSignature:
        return Verdict(SignatureState.BAD_SIGNATURE, signer,
                       f"the signature by key {signer} does not match the manifest (changed after signing, or "
                       "signed for another name)")
    except (TypeError, ValueError) as error:  # a value JSON cannot carry canonically (NaN)
        return Verdict(SignatureState.BAD_SIGNATURE, signer, f"the manifest cannot be put in canonical form ({error})")
    return Verdict(SignatureState.TRUSTED, signer)


def _shown(value) -> str:
    text = repr(value)
    return f"{text[:40]}{'…' if len(text) > 40 else ''} ({type(value).__name__})"
