"""A Hugging Face Hub on loopback for the download tests: the routes huggingface_hub's snapshot_download calls
(repo info, the recursive tree, resolve with HEAD and byte ranges), gated repositories answering 401 without a token
and 403 with one lacking access, 404 for the rest — as the Hub answers, with its X-Error-Code headers — and switches
that cut one transfer short or stall it, to test resuming. Nothing leaves the machine."""
from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class Repo:
    folder: Path
    gated: bool = False
    tokens: frozenset[str] = frozenset()  # tokens of accounts that accepted its terms

    def files(self) -> dict[str, Path]:
        return {str(path.relative_to(self.folder)): path for path in sorted(self.folder.rglob("*")) if path.is_file()}


@dataclass
class Hub:
    repos: dict[str, Repo] = field(default_factory=dict)
    # path -> bytes sent before the connection is cut, once; path -> bytes sent before the transfer stalls, once, until
    # `released` is set (a client killed meanwhile leaves its part-file behind).
    cut_once: dict[str, int] = field(default_factory=dict)
    stall_once: dict[str, int] = field(default_factory=dict)
    released: threading.Event = field(default_factory=threading.Event)
    # Every request, as (method, path, Range header).
    seen: list[tuple[str, str, str | None]] = field(default_factory=list)
    url: str = ""


def _oid(path: Path) -> str:
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def serve(hub: Hub) -> ThreadingHTTPServer:
    """Serve `hub` on a free loopback port in a daemon thread; `hub.url` is its address."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def _error(self, status: int, code: str, message: str) -> None:
            body = json.dumps({"error": message}).encode()
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", message)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _json(self, value) -> None:
            body = json.dumps(value).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _repo(self, repo_id: str) -> Repo | None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                self._error(404, "RepoNotFound", f"Repository Not Found for url: {self.path}.")
                return None
            if repo.gated:
                token = self.headers.get("authorization", "").removeprefix("Bearer ").strip()
                if not token:
                    self._error(401, "GatedRepo", f"Access to model {repo_id} is restricted. You must have access "
                                                  "to it and be authenticated to access it. Please log in.")
                    return None
                if token not in repo.tokens:
                    self._error(403, "GatedRepo", f"Access to model {repo_id} is restricted and you are not in the "
                                                  "authorized list.")
                    return None
            return repo

        def do_HEAD(self) -> None:
            self.do_GET()

        def do_GET(self) -> None:
            path = unquote(urlparse(self.path).path)
            hub.seen.append((self.command, path, self.headers.get("Range")))
            if match := re.fullmatch(r"/api/models/(.+?)/revision/([^/]+)", path):
                repo = self._repo(match[1])
                if repo:
                    self._json({"id": match[1], "modelId": match[1], "sha": COMMIT, "private": False,
                                "gated": "manual" if repo.gated else False, "disabled": False, "tags": [],
                                "siblings": [{"rfilename": name} for name in repo.files()]})
                return
            if match := re.fullmatch(r"/api/models/(.+?)/tree/([^/]+)(/.*)?", path):
                repo = self._repo(match[1])
                if repo:
                    entries, folders = [], set()
                    for name, file in repo.files().items():
                        parts = name.split("/")
                        folders.update("/".join(parts[:i]) for i in range(1, len(parts)))
                        entries.append({"type": "file", "oid": _oid(file), "size": file.stat().st_size, "path": name})
                    self._json([{"type": "directory", "oid": "0" * 40, "size": 0, "path": f} for f in sorted(folders)]
                               + entries)
                return
            if match := re.fullmatch(r"/(.+?)/resolve/([^/]+)/(.+)", path):
                repo = self._repo(match[1])
                if repo is None:
                    return
                file = repo.files().get(match[3])
                if file is None:
                    self._error(404, "EntryNotFound", f"Entry Not Found for url: {self.path}.")
                    return
                self._file(match[3], file)
                return
            self._error(404, "RepoNotFound", f"Repository Not Found for url: {self.path}.")

        def _file(self, name: str, file: Path) -> None:
            data = file.read_bytes()
            start = 0
            ranged = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", "") or "")
            if ranged:
                start = int(ranged[1])
            self.send_response(206 if ranged else 200)
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("ETag", f'"{_oid(file)}"')
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(len(data) - start))
            if ranged:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.end_headers()
            if self.command == "HEAD":
                return
            stall = hub.stall_once.pop(name, None) if not ranged else None
            if stall is not None:
                self.wfile.write(data[:stall])
                self.wfile.flush()
                hub.released.wait(300)
                self.close_connection = True
                return
            cut = hub.cut_once.pop(name, None) if not ranged else None
            if cut is not None:  # the connection drops mid-transfer
                self.wfile.write(data[:cut])
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(2)
                return
            self.wfile.write(data[start:])

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    threading.Thread(target=server.serve_forever, name="fake-hub", daemon=True).start()
    return server
