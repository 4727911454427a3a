"""How tests build an engine (as the app does, with its executor chosen outside it) and serve it."""
import contextlib
import dataclasses
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from acceldemo.builder import build_engine
from acceldemo.config import Settings
from acceldemo.engine import Engine


def settings_with(**overrides) -> Settings:
    """This test run's settings (the environment conftest prepared), with `overrides`."""
    return dataclasses.replace(Settings.from_env(), **overrides)


def new_manager(settings: Settings | None = None, **overrides) -> Engine:
    """An engine as the app builds one, on the test run's settings with `overrides`."""
    settings = settings or Settings.from_env()
    return build_engine(dataclasses.replace(settings, **overrides))


def wait_until_answers(url: str, process, log: Path | None = None, timeout: float = 120) -> None:
    """Until GET `url` answers (2xx); fails with the log's tail (when there is one) as soon as `process` has ended,
    or once `timeout` seconds have gone by."""
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            ended = process.poll() is not None
            if ended or time.monotonic() > deadline:
                tail = log.read_text()[-3000:] if log is not None and log.exists() else ""
                raise AssertionError(f"{url} never answered ({'the process ended' if ended else 'timed out'}):\n"
                                     f"{tail}") from None
            time.sleep(0.5)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def serving(app, **config) -> Iterator[str]:
    """A FastAPI app served by uvicorn on a free loopback port in this process (so a test can call its engine
    directly beside its HTTP clients); yields the base URL. `config`: more of uvicorn's settings."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **config))
    thread = threading.Thread(target=server.run, name="test-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the in-process server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


class DeviceHolder:
    """A generation that holds the manager's device at its first denoise step until `release()`."""

    def __init__(self, manager: Engine):
        from acceldemo.records import GenerateParams, Phase

        self._holding, self._released = threading.Event(), threading.Event()

        def hold(event) -> None:
            if event.phase is Phase.DENOISE:
                self._holding.set()
                self._released.wait(120)

        self.thread = threading.Thread(target=manager.generate,
                                       args=(GenerateParams(prompt="first", hardware="cpu", steps=1), hold))

    def start(self) -> None:
        """Start it; returns once it holds the device."""
        self.thread.start()
        assert self._holding.wait(120), "the holding job never reached its first step"

    def release(self) -> None:
        self._released.set()
        self.thread.join(60)

    def is_alive(self) -> bool:
        return self.thread.is_alive()


def processes_started_by(app_pid: int) -> list[int]:
    """Running processes of a pool that the app `app_pid` launched (torchrun and ranks carry its pid in their
    environment), so other pools running on this machine at the same time do not count."""
    marker = f"ACCELDEMO_POOL_APP_PID={app_pid}\0".encode()
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and marker in Path(f"/proc/{entry}/environ").read_bytes():
                found.append(int(entry))
        except OSError:
            pass
    return found


@contextlib.contextmanager
def s3_server():
    """moto's real S3 server on a free loopback port, with a bucket; yields (endpoint, fsspec options)."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    # One attempt and a short connect timeout: an outage shows at once instead of after botocore's retries.
    options = {"client_kwargs": {"endpoint_url": endpoint},
               "config_kwargs": {"connect_timeout": 2, "retries": {"max_attempts": 1}}}
    import s3fs

    # moto's backends live in this process: a second server sees the first one's bucket.
    s3fs.S3FileSystem(skip_instance_cache=True, **options).makedirs("fleet", exist_ok=True)
    try:
        yield server, options
    finally:
        server.stop()
