"""What the subcommands share: the parser class and help formatter, the request options, sizes, progress lines,
output folders and picture files."""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from ..errors import InvalidRequest
from ..hardware import all_modes, hardware_names
from ..models.caches import STEP_CACHE_CHOICES
from ..records import GenerateParams, Phase, Placement, Progress, Quantization, Shape

PROG = "python -m acceldemo"


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help already says it (`default ...`)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or not action.option_strings or action.required or \
                action.default in (None, False, argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"


class CommandParser(argparse.ArgumentParser):
    """A subcommand's parser: an argument it does not know is refused with its own usage (`... generate`), not the
    top-level one argparse would show once the leftovers reach the top."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


def shape_arg(text: str) -> Shape:
    shape = Shape.parse(text)
    if shape is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: write WIDTHxHEIGHT, e.g. 1024x1024")
    return shape


class TerminalProgress:
    """Progress events as terminal lines; denoise steps overwrite one line on a terminal."""

    def __init__(self, stream=sys.stderr, previews: Path | None = None):
        self.stream = stream
        self.started = time.perf_counter()
        self.tty = stream.isatty()
        self.last = ""
        # Where each preview goes as a PNG (`--previews DIR`), named `{preview_name}-{image}-step{step}.png`.
        self.previews = previews
        self.preview_name = "preview"

    def __call__(self, event: Progress) -> None:
        elapsed = time.perf_counter() - self.started
        text = f"[{elapsed:7.2f}s] {event.phase:<8} {event.message}"
        if event.preview is not None and self.previews is not None:
            event.preview.image().save(self.previews / f"{self.preview_name}-{event.image}-step{event.step:03d}.png")
        again, self.last = event.message == self.last, event.message
        if event.phase is Phase.COMPILE and again:  # the same compile a second later: on a terminal, its clock
            if self.tty and event.expected:
                self.stream.write(f"{text} [{event.elapsed:.0f} of about {event.expected:.0f} s]\r")
        elif event.phase is Phase.DENOISE and self.tty:
            end = "\n" if event.step == event.total else "\r"
            self.stream.write(text + end)
        elif event.phase is not Phase.DENOISE or event.step == event.total:
            self.stream.write(text + "\n")
        self.stream.flush()


def request_args(parser: argparse.ArgumentParser) -> None:
    """The options that shape a request, shared by generate and warmup."""
    parser.add_argument("--model", help="catalog model (default: the embedded tiny model); see `info`")
    parser.add_argument("--hardware", choices=hardware_names(),
                        help="default: the first accelerator found, else cpu")
    parser.add_argument("--device", help="a device (cuda:1) or group (neuron:0-1) to run on; default: any free one")
    parser.add_argument("--mode", choices=[str(m) for m in all_modes()], help="default: eager")
    parser.add_argument("--placement", choices=[str(p) for p in Placement],
                        help="default: proposed from the model size and device memory")
    parser.add_argument("--tp", type=int, dest="tp_size",
                        help="tensor-parallel world size with --placement tp (default: the proposal's)")
    parser.add_argument("--cp", type=int, dest="cp_size",
                        help="context-parallel degree with --placement cp (ranks the image tokens are spread over; "
                             "default: the proposal's)")
    parser.add_argument("--size", type=shape_arg, action="append", dest="sizes", metavar="WxH",
                        help="image size; repeat for several (default: the model's)")
    parser.add_argument("--quantization", choices=[str(q) for q in Quantization],
                        help="weights: none (default), int8 (torchao weight-only, any hardware), fp8 (CUDA sm_89+)")
    parser.add_argument("--step-cache", dest="step_cache", metavar="NAME",
                        help=f"reuse work across denoise steps: {', '.join(STEP_CACHE_CHOICES)} (auto: the model's "
                             "advice; `info` lists what each model offers and why others are refused; default: "
                             "none)")


def artifacts_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--artifacts", metavar="URL",
                        help="the shared artifact store: a shared folder, s3://bucket/prefix, gs://bucket/prefix "
                             "or hf://datasets/ORG/NAME (default: env ACCELDEMO_ARTIFACTS, else none; options: "
                             "ACCELDEMO_ARTIFACTS_OPTIONS)")


def download_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--download", action="store_true",
                        help="fetch a real model missing here from the Hugging Face Hub (env ACCELDEMO_DOWNLOAD; "
                             "HF_TOKEN for gated repositories)")


def request_params(args, prompt: str = "warm-up", **extra) -> list[GenerateParams]:
    """One raw request per --size (the model's default size without one)."""
    return [GenerateParams(prompt=prompt, model=args.model, hardware=args.hardware, mode=args.mode,
                           placement=args.placement, tp_size=args.tp_size, cp_size=args.cp_size, device=args.device,
                           resolution=size,
                           quantization=args.quantization, step_cache=args.step_cache, **extra)
            for size in args.sizes or [None]]


def check_output_folder(folder: Path, field: str = "out") -> Path:
    """The folder for the images, created now and proved writable, so no image is made only to be lost."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".acceldemo-write-check-"):
            pass
    except OSError as error:
        raise InvalidRequest(field, str(folder), f"a folder this user can create and write to "
                                                 f"({error.strerror or type(error).__name__})") from None
    return folder


def read_picture(path: Path, field: str) -> bytes:
    """A picture file's bytes (at most one past the engine's limit, which it then refuses by size)."""
    from ..engine.pictures import MAX_IMAGE_BYTES

    try:
        with open(path, "rb") as file:
            return file.read(MAX_IMAGE_BYTES + 1)
    except OSError as error:
        raise InvalidRequest(field, str(path), f"a picture file this user can read ({error.strerror or error})") \
            from None


def lora_option(text: str | None) -> dict:
    """--lora NAME[:SCALE] as the request's lora and lora_scale."""
    if not text:
        return {}
    name, _, scale = text.rpartition(":") if ":" in text else (text, "", "")
    return {"lora": name, "lora_scale": scale or None}
