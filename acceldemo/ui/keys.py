"""Who is calling: client keys (ACCELDEMO_API_KEYS, a file of `NAME SHA256` lines), the operator key
(ACCELDEMO_ADMIN_KEY or ACCELDEMO_ADMIN_KEY_FILE) and the older single ACCELDEMO_API_TOKEN (one client key called
`token` that is also the operator key). A key arrives as `Authorization: Bearer KEY`; it is hashed and compared with
every entry in constant time, and neither it nor its hash is ever logged or shown.

The key file is read again when it changes, so deleting a line revokes that key without a restart; a changed file
that no longer parses keeps the keys read last (logged as an error) rather than locking every client out."""
from __future__ import annotations

import hashlib
import hmac
import logging
import re
import threading
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("acceldemo.keys")

# A client's name: it labels /metrics and the logs, so it is short and plain.
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
SHA256 = re.compile(r"[0-9a-f]{64}")
# The operator key is typed by a person once and guards every operator action: too short is refused at start-up.
ADMIN_KEY_MIN_CHARS = 16
# The client name ACCELDEMO_API_TOKEN is counted under.
TOKEN_CLIENT = "token"
# Callers without a key: the page's visitors (and anyone else where no key is needed).
VISITOR = "visitor"
MAKE_A_KEY = ("make one with: KEY=$(python -c 'import secrets; print(secrets.token_urlsafe(32))'); "
              "echo \"NAME $(printf %s \"$KEY\" | sha256sum | cut -d' ' -f1)\"")


class KeyFileError(ValueError):
    """A key setting that cannot be used: the message names the file (and line) and what is wrong."""


@dataclass(frozen=True)
class Caller:
    """Who a request is: `client` is a key's name (VISITOR without one) and `operator` whether it may take the
    operator's actions."""

    client: str
    operator: bool


class Refused(Exception):
    """A request the keys turn away: 401 (no key, or one that is not a key here) or 403 (a client key asking for an
    operator action)."""

    def __init__(self, status: int, message: str, caller: Caller | None = None):
        super().__init__(message)
        self.status, self.message, self.caller = status, message, caller


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def parse_key_file(text: str, where: str) -> dict[str, bytes]:
    """`NAME SHA256` lines (blank lines and `#` comments skipped) to name -> digest; a line that is not one says so."""
    keys: dict[str, bytes] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        if len(fields) != 2:
            raise KeyFileError(f"{where}:{number}: a line is a client name and its key's sha256 (2 fields), "
                               f"not {len(fields)}; {MAKE_A_KEY}")
        name, hashed = fields[0], fields[1].lower()
        if not NAME.fullmatch(name):
            raise KeyFileError(f"{where}:{number}: a client name is 1-64 letters, digits, '.', '_' or '-', starting "
                               "with a letter or digit")
        if not SHA256.fullmatch(hashed):
            raise KeyFileError(f"{where}:{number}: the second field must be the key's sha256 (64 hex digits), never "
                               f"the key itself; {MAKE_A_KEY}")
        if name in keys:
            raise KeyFileError(f"{where}:{number}: client {name!r} is named twice")
        keys[name] = bytes.fromhex(hashed)
    if not keys:
        raise KeyFileError(f"{where}: no client keys in it; {MAKE_A_KEY}")
    return keys


def read_key_file(path: Path) -> dict[str, bytes]:
    try:
        data = path.read_bytes()
    except OSError as error:
        raise KeyFileError(f"ACCELDEMO_API_KEYS {path}: cannot be read ({error.strerror or error})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise KeyFileError(f"ACCELDEMO_API_KEYS {path}: not UTF-8 text") from None
    return parse_key_file(text, f"ACCELDEMO_API_KEYS {path}")


def _operator_key(admin_key: str | None, admin_key_file: str | None) -> str | None:
    if admin_key and admin_key_file:
        raise KeyFileError("set ACCELDEMO_ADMIN_KEY or ACCELDEMO_ADMIN_KEY_FILE, not both")
    if admin_key_file:
        try:
            admin_key = Path(admin_key_file).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as error:
            raise KeyFileError(f"ACCELDEMO_ADMIN_KEY_FILE {admin_key_file}: cannot be read "
                               f"({getattr(error, 'strerror', None) or type(error).__name__})") from None
        if not admin_key:
            raise KeyFileError(f"ACCELDEMO_ADMIN_KEY_FILE {admin_key_file}: empty")
    if admin_key is not None and (len(admin_key) < ADMIN_KEY_MIN_CHARS or any(c.isspace() for c in admin_key)):
        raise KeyFileError(f"the operator key must be at least {ADMIN_KEY_MIN_CHARS} characters without spaces; "
                           "make one with: python -c 'import secrets; print(secrets.token_urlsafe(32))'")
    return admin_key


class Keys:
    """The keys a server knows. `required`: whether /v1 and the MCP server need a client key (any key setting);
    `operator_required`: whether operator actions need the operator key (any key setting: with client keys but no
    operator key, nobody may take them)."""

    def __init__(self, clients: dict[str, bytes] | None = None, operator: str | None = None,
                 key_file: Path | None = None):
        self._clients = dict(clients or {})
        self._operator = digest(operator) if operator else None
        self._file = key_file
        self._seen: tuple | None = self._stamp() if key_file else None
        self._lock = threading.Lock()

    @classmethod
    def from_settings(cls, api_keys: str | None = None, admin_key: str | None = None,
                      admin_key_file: str | None = None, api_token: str | None = None) -> Keys:
        """The keys the settings name (KeyFileError, naming the setting, when one cannot be used)."""
        operator = _operator_key(admin_key, admin_key_file)
        clients = read_key_file(Path(api_keys)) if api_keys else {}
        if api_token:
            if TOKEN_CLIENT in clients:
                raise KeyFileError(f"ACCELDEMO_API_KEYS names a client {TOKEN_CLIENT!r}, the name ACCELDEMO_API_TOKEN "
                                   "is counted under: rename it")
            clients[TOKEN_CLIENT] = digest(api_token)
            operator = operator or api_token
        return cls(clients, operator, Path(api_keys) if api_keys else None)

    @property
    def required(self) -> bool:
        return bool(self._clients) or self._operator is not None

    operator_required = required

    def _stamp(self) -> tuple | None:
        try:
            stat = self._file.stat()
        except OSError:
            return None
        return stat.st_mtime_ns, stat.st_size, stat.st_ino

    def _current(self) -> dict[str, bytes]:
        """The client keys, read again when the file changed since the last read."""
        if self._file is None:
            return self._clients
        stamp = self._stamp()
        if stamp != self._seen:
            with self._lock:
                if stamp != self._seen:
                    self._seen = stamp
                    try:
                        clients = read_key_file(self._file)
                    except KeyFileError as error:
                        log.error("%s: keeping the %d client key(s) read before", error, len(self._clients))
                    else:
                        if TOKEN_CLIENT in self._clients and TOKEN_CLIENT not in clients:
                            clients[TOKEN_CLIENT] = self._clients[TOKEN_CLIENT]
                        log.info("client keys read again: %d", len(clients))
                        self._clients = clients
        return self._clients

    def caller(self, authorization: str | None) -> Caller | None:
        """Whom an Authorization header names: None without a header (or without any key set); Refused(401) for a
        header that is not `Bearer <a key here>`."""
        if not self.required or not authorization:
            return None
        scheme, _, key = authorization.strip().partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise Refused(401, "the Authorization header must be `Bearer <key>`")
        if len(key) > 4096:
            raise Refused(401, "this key is not valid here")
        given = digest(key)
        operator = self._operator is not None and hmac.compare_digest(given, self._operator)
        client = None
        for name, hashed in self._current().items():  # every entry compared: the time says nothing of which
            if hmac.compare_digest(given, hashed):
                client = name
        if client is None and not operator:
            raise Refused(401, "this key is not valid here (unknown or revoked)")
        return Caller(client or "operator", operator)

    def known(self, authorization: str | None) -> Caller | None:
        """The caller a header names, or None (no header, or one the doors refuse): for handlers behind a door that
        already answered 401 to a bad key."""
        try:
            return self.caller(authorization)
        except Refused:
            return None

    def client_door(self, authorization: str | None) -> Caller:
        """A door that needs a client key when keys are set (/v1, the MCP server)."""
        found = self.caller(authorization)
        if found is None:
            if self.required:
                raise Refused(401, "this route needs Authorization: Bearer <key> (a client key)")
            return Caller(VISITOR, True)
        return found

    def operator_door(self, authorization: str | None) -> Caller:
        """A door for the operator only when keys are set (/status, /metrics, warm-up of new shapes)."""
        found = self.client_door(authorization)
        if not found.operator:
            raise Refused(403, f"client {found.client!r}: this is an operator action; it needs the operator key",
                          found)
        return found

    def operator_key(self, key: str | None) -> bool:
        """Whether a key typed into the page is the operator key (always, when none is needed)."""
        if not self.operator_required:
            return True
        return bool(key) and self._operator is not None and hmac.compare_digest(digest(key.strip()), self._operator)


# The header a ZeroGPU Space's front end adds to a visitor's requests: passed on when a draw asks the platform for a
# GPU, so that visitor's own quota is charged (`records.VISITOR_TOKEN`).
VISITOR_TOKEN_HEADER = "x-ip-token"


def visitor_token(headers) -> str | None:
    """The platform's token for the visitor in a request's headers (any case), or None."""
    return (headers.get(VISITOR_TOKEN_HEADER) or None) if headers is not None else None


# OpenAI's `user` / `safety_identifier` as a client within a key: longer ones are refused (400).
MAX_USER_CHARS = 256


def client_name(caller: Caller | None, user: str | None = None, session: str | None = None,
                peer: str | None = None) -> str:
    """Whom the line takes turns across: a key's name (with the OpenAI `user` or `safety_identifier` within it); for a
    caller without a key, the page's session, else the peer address (uvicorn's, which trusts forwarded headers only
    from `--forwarded-allow-ips` / FORWARDED_ALLOW_IPS). A `user` without a key names nobody: anyone can type one."""
    if caller is not None and caller.client != VISITOR:
        return f"{caller.client}/{user}" if user else caller.client
    if session:
        return f"session:{session}"
    return f"peer:{peer or 'unknown'}"

