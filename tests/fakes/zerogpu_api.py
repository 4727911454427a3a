"""A stand-in of ZeroGPU's device API on loopback, and the smallest patches that let the real `spaces` package (0.51.3)
run its ZeroGPU path on a CPU-only torch — read in its source (`spaces/zero/client.py`, `api.py`, `wrappers.py`,
`torch/patching.py`), as tests/fake_hub.py does for the Hub.

The stand-in answers what `spaces` sends: `POST /schedule` (a GPU is free: JSON with a `content-type`), `/allow`
(from the forked child, with its pid), `/release` and `/startup-report`; it records every call.

The patches stand in for a CUDA build only; the decorator, the scheduling, the fork, the pipe and the release are
the package's own code:
- `torch.version.cuda`: `spaces` reads it at import (`torch/static.py`), None on a CPU build;
- `torch._C._cuda_init`: `spaces` replaces it, so it must exist;
- `torch.cuda._is_in_bad_fork`: asked in a process pool at import, so it must pickle (a CPU build's is a lambda);
- `spaces.zero.torch.init` / `move`: in the child they make the lent GPU current and move what `.to("cuda")` put
  aside at start to it; with no GPU, the CPU tensors stay.
"""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse


class ZeroGpuApi:
    """The device API on 127.0.0.1, in a thread; `calls` is every request as (path, query). `reuse`: after the first
    schedule, say the GPU stayed idle (`spaces` then sends the next call to the child it forked before); `uuid`: the
    GPU the child is given (`CUDA_VISIBLE_DEVICES`), a real one's on a CUDA host."""

    def __init__(self, reuse: bool = False, uuid: str = "GPU-standin"):
        self.calls: list[tuple[str, dict[str, str]]] = []
        # What /schedule answers: "gpu" (one is lent), "quota" (429: 30 s left, try again in 1 min 23 s) or
        # "no_gpu" (503).
        self.answer = "gpu"
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                url = urlparse(self.path)
                api.calls.append((url.path, {k: v[0] for k, v in parse_qs(url.query).items()}))
                body = b""
                status = 200 if url.path in ("/schedule", "/allow", "/release", "/startup-report") else 404
                if url.path == "/schedule" and api.answer == "quota":
                    status, body = 429, json.dumps({"left": 30, "wait": "PT1M23S"}).encode()
                elif url.path == "/schedule" and api.answer == "no_gpu":
                    status = 503
                elif url.path == "/schedule":
                    idle = reuse and any(path == "/schedule" for path, _ in api.calls[:-1])
                    body = json.dumps({"idle": idle, "nvidiaIndex": 0, "nvidiaUUID": uuid,
                                       "allowToken": "token-1"}).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def patch_cpu_torch_for_spaces() -> None:
    """Before `import spaces`, on a CPU-only torch (see the module's docstring)."""
    import torch

    torch.version.cuda = "12.8"
    if not hasattr(torch._C, "_cuda_init"):
        def _cuda_init():
            raise AssertionError("no CUDA on this host")

        torch._C._cuda_init = _cuda_init
    torch.cuda._is_in_bad_fork = bool


def keep_tensors_on_cpu_in_the_child() -> None:
    """After `import spaces`: the child's GPU set-up and weight move become no-ops."""
    import spaces.zero.torch as zero_torch

    zero_torch.init = lambda uuid: None
    zero_torch.move = lambda callback=None: None


def lend_the_cpu() -> None:
    """The ZeroGPU adapter replaced by one whose lent device is the CPU (what the child moves the pipeline to)."""
    from acceldemo import hardware
    from acceldemo.hardware.zerogpu import ZeroGpuHardware

    class ZeroGpuOnCpu(ZeroGpuHardware):
        device = "cpu"

    hardware.unregister(ZeroGpuHardware.name)
    hardware.register(ZeroGpuOnCpu)
