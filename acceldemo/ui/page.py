"""The Gradio page: components and events; each handler translates the page's values into one engine call and its
result (or its error) back, and the panels render the engine's snapshot."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import gradio as gr
import pandas as pd

from ..engine import Description, Engine, ModelView, Offer, Snapshot, together
from ..engine.compare import Comparison
from ..engine.pictures import DEFAULT_STRENGTH
from ..errors import AcceldemoError
from ..executors.recipe import BUCKETS
from ..hardware import all_modes, host_kinds
from ..models.caches import AUTO as AUTO_CACHE
from ..models.caches import NONE as NO_CACHE
from ..records import EditInput, EditMethod, GenerateParams, GenerateResult, Phase, Placement, Progress, Quantization
from .keys import Keys, client_name, visitor_token
from .watch import WatchedJob

log = logging.getLogger("acceldemo.ui")
AUTO = "auto"
NO_STYLE = "none"
NOT_THE_OPERATOR_KEY = "That is not the operator key."
OPERATOR_ONLY = ("{action} is the operator's action: it needs the operator key (type it in the Operator tab, or send "
                 "Authorization: Bearer <operator key> with the API call)")
STATUS_COLUMNS = ["pipeline", "resident", "shape", "batch", "state", "compile s", "graphs", "hits", "first call s",
                  "last warm s", "reason"]
REPLICA_COLUMNS = ["replica", "node", "state", "waiting", "shapes held", "served", "last latency s", "restarts",
                   "devices"]
STOPPED = "**Stopped.** A running job ends at its next denoise step, which frees the device."
NOTHING_TO_STOP = "Nothing to stop: no job of this page is running."
# ColorBrewer hue pairs, one per mode in the hardware registry's order (cycled if there are more modes): the middle
# shade for the first call, the dark one for warm calls.
_PALETTE = (("#6baed6", "#08519c"), ("#9e9ac8", "#54278f"), ("#fd8d3c", "#a63603"), ("#74c476", "#006d2c"),
            ("#fc9272", "#a50f15"), ("#bdbdbd", "#252525"))


def series_colors() -> dict[str, str]:
    """The latency chart's colour per series ("compiled first call", "compiled warm", ...) for every mode."""
    return {f"{mode} {kind}": color for i, mode in enumerate(all_modes())
            for kind, color in zip(("first call", "warm"), _PALETTE[i % len(_PALETTE)])}


def _params(prompt, model, hardware, mode, placement, tp_size, resolution, steps, guidance, seed,
            previews: bool = False, picture=None, strength=None, lora=None, lora_scale=None, step_cache=None,
            quantization=None) -> GenerateParams:
    """The page's values as the engine's raw request (the placement "auto" is the engine's own proposal; the
    strength counts only with a picture, the style strength only with a style, as the engine wants them)."""
    placement = None if placement in (None, AUTO) else placement
    styled = lora not in (None, "", NO_STYLE)
    # The page's one degree field is the tensor-parallel size with tp, the context-parallel degree with cp.
    return GenerateParams(prompt=prompt, model=model, hardware=hardware, mode=mode, placement=placement,
                          tp_size=tp_size if placement == Placement.TP else None,
                          cp_size=tp_size if placement == Placement.CP else None, resolution=resolution, steps=steps,
                          guidance=guidance, seed=seed, previews=previews, image=picture,
                          strength=strength if picture is not None else None, lora=lora if styled else None,
                          lora_scale=lora_scale if styled else None, step_cache=step_cache,
                          quantization=quantization)


def picture_upload(**options) -> gr.Image:
    """An Image input that hands the engine the uploaded file's bytes: the engine checks pictures and says what is
    wrong with a file that is not one, where the stock preprocessing opens it first and answers a non-picture with
    Gradio's generic error. Not a subclass: Gradio's component metaclass writes a .pyi beside the module that
    defines one, on every import."""
    picture = gr.Image(**options)
    stock = picture.preprocess

    def as_uploaded(payload):
        if payload is None or payload.path is None:  # nothing, or a pasted data: URL (decoded the stock way)
            return stock(payload)
        return Path(payload.path).read_bytes()

    picture.preprocess = as_uploaded
    return picture


# The picture fills its frame whatever its size, scaled up without smoothing: a 64x64 image is 384 px of sharp
# blocks, not 64 screen pixels in an empty box (and not a blur).
CSS = """
#image img, #compare-a-image img, #compare-b-image img {
    width: 100%; height: 100%; object-fit: contain; image-rendering: pixelated; }
"""


def _show(progress: gr.Progress, event: Progress) -> None:
    # Gradio hides the text with the bar when the fraction is None, so phases without steps show 0; a compile whose
    # kind was timed here before advances by elapsed ÷ expected.
    progress(event.fraction or 0.0,
             desc=event.message if event.phase is not Phase.DENOISE else f"denoise {event.message}")


# How often image_file looks for its folder's old files, and when it last did, per folder.
SWEEP_EVERY_S = 10.0
_SWEPT: dict[Path, float] = {}


def image_file(image, folder: Path) -> str:
    """The image as a PNG file of its own, for Gradio to copy into its cache.

    Gradio keeps a returned PIL image at a path named by its content and rewrites that file in place on every
    return, so two people asking the same prompt and seed at once can download it half-written (seen in bench §7:
    "peer closed connection without sending complete message body"). A returned file is copied in under a
    temporary name and renamed. Gradio copies it as the event ends, so files older than a minute are done with.
    """
    if time.monotonic() - _SWEPT.get(folder, -SWEEP_EVERY_S) >= SWEEP_EVERY_S:  # not a folder's listing per image
        _SWEPT[folder] = time.monotonic()
        for old in folder.glob("*.png"):
            with contextlib.suppress(FileNotFoundError):
                if time.time() - old.stat().st_mtime > 60:
                    old.unlink()
    fd, path = tempfile.mkstemp(suffix=".png", dir=folder)
    with os.fdopen(fd, "wb") as out:
        image.save(out, format="png")
    return path


def describe_edit(edit: EditInput) -> str:
    """What an edit started from and how it changed it."""
    how = (f"image-to-image at strength **{edit.strength:g}**" if edit.method == EditMethod.STRENGTH else
           f"inpainting at strength **{edit.strength:g}**" if edit.method == EditMethod.INPAINT else
           f"{len(edit.images)} reference picture(s)")
    return f"edit: {how} · from {edit.source}"


def describe_result(result: GenerateResult) -> str:
    """The facts a person reads beside the image: first the timing line (total, compile, denoise, load, queue wait,
    and what the acceleration choices bought), then what was drawn and how. Only a compiled mode speaks of graphs:
    whether this call compiled, loaded saved artifacts or reused what was compiled."""
    r = result.request
    if result.from_cache:
        return (f"**{r.width}x{r.height}** · {r.model} · seed {r.seed} · **from cache**: an identical request drew "
                f"this image before; answered in {result.seconds * 1000:.2f} ms")
    timing = [f"total **{result.seconds:.3f} s**"]
    if r.mode.compiles:
        timing.append(f"compile {result.compile_seconds:.2f} s")
    if result.denoise_seconds is not None:
        timing.append(f"denoise {result.denoise_seconds:.2f} s")
    timing += [f"load {result.load_seconds:.2f} s", f"queue wait {result.queue_wait:.2f} s"]
    what = [f"**{r.width}x{r.height}**", r.model, str(result.key.devices), str(r.mode), str(r.placement),
            f"steps {r.steps}", f"seed {r.seed}"]
    if r.mode.compiles:
        what.append("reused a compiled graph" if result.warm else
                    f"first visit: {result.new_graphs} graph(s) compiled" if result.new_graphs else
                    f"first visit: {result.compile_cache_hits} saved compile artifact(s) reused"
                    if result.compile_cache_hits else "first visit to this shape: no graph compiled")
    if result.batch > 1:
        what.append(together(result.batch - 1))
    return "  \n".join([" · ".join(timing + bought(result)), " · ".join(what), *drawn_with(r),
                        *([f"**{result.note}**"] if result.note else [])])


def bought(result: GenerateResult) -> list[str]:
    """What the acceleration choices did for this image: the step cache's skipped calls, the weights' size."""
    cache, notes = result.facts()["step_cache"], []
    if cache["ran"] != "none":
        notes.append(f"step cache **{cache['ran']}**: {cache['skipped']} of {cache['calls']} transformer calls "
                     "answered from the cache")
    elif cache["asked"] == "auto":
        notes.append(f"step cache auto: none ({cache['why']})")
    if result.request.quantization is not Quantization.NONE:
        notes.append(f"**{result.request.quantization}** weights")
    if result.weight_bytes:
        notes.append(f"weights {result.weight_bytes / 1e6:.1f} MB")
    return notes


def drawn_with(request) -> list[str]:
    """The edit and the style an image was drawn with, one line (none when it was neither)."""
    parts = [describe_edit(request.edit)] if request.edit else []
    if request.lora:
        parts.append(f"style **{request.lora}** at strength {request.lora_scale:g}")
    return [" · ".join(parts)] if parts else []


def describe_packages(store: dict) -> str:
    """One line on the saved compiled transformers that let a restart skip compiling (mode compiled, CPU/CUDA)."""
    if store["setting"] == "off":
        return "Precompiled packages: off (ACCELDEMO_PRECOMPILE=off)"
    rate = "" if store["hit_rate"] is None else f", {store['hit_rate']:.0%} of first visits loaded one"
    return (f"Precompiled packages: {store['packages']} on disk ({store['megabytes']} MB); since start "
            f"{store['built']} built, {store['loaded']} loaded{rate}" + describe_store(store.get("store")))


def describe_store(store: dict | None) -> str:
    """The shared artifact store's line: what came from it and went to it, or its outage (and that the app compiles
    locally meanwhile); empty without a store."""
    if store is None:
        return ""
    if not store["reachable"]:
        return (f"  \n**Shared artifact store {store['url']} unreachable** ({store['error']}): compiling locally, "
                "serving on")
    refusals = ", ".join(f"{count} {reason.replace('_', ' ')}" for reason, count in
                         (store.get("rejections") or {}).items() if count)
    trust = (f"packages signed by {', '.join(store['trusted_keys'])} only" if store.get("trusted_keys") else
             "**no ACCELDEMO_ARTIFACTS_TRUST: packages load on a checksum kept in the same store**")
    return (f"  \nShared artifact store {store['url']}: {store['fetched']} fetched, {store['published']} published, "
            f"{store['rejected']} refused{f' ({refusals})' if refusals else ''}; {trust}")


def status_rows(snapshot: Snapshot) -> pd.DataFrame:
    rows = []
    for p in snapshot.pipelines:
        for s in p.shapes:
            rows.append([str(p.key), "yes" if p.resident else "evicted", str(s.shape), s.batch, str(s.state),
                         round(s.compile_seconds, 2), s.graphs, s.hits,
                         None if s.first_call_seconds is None else round(s.first_call_seconds, 3),
                         None if s.last_latency is None else round(s.last_latency, 3), s.reason])
    return pd.DataFrame(rows, columns=STATUS_COLUMNS)


def replica_rows(snapshot: Snapshot) -> pd.DataFrame:
    """Each replica: its devices, what it is doing, who waits for it, what it holds and has served."""
    devices = {(d.device.hardware, d.device.index): d.device for d in snapshot.devices}
    rows = []
    for r in snapshot.replicas:
        held = [devices.get((r.devices.hardware, i)) for i in r.devices.indices]
        rows.append([str(r.devices), r.node, r.shown, r.waiting, " ".join(map(str, r.shapes)), r.served,
                     None if r.last_latency is None else round(r.last_latency, 3), r.restarts,
                     "; ".join(f"{d} {d.memory_bytes / 1e9:.1f} GB {d.detail}".strip() for d in held if d)])
    return pd.DataFrame(rows, columns=REPLICA_COLUMNS)


def latency_points(snapshot: Snapshot) -> list[tuple[str, str, float]]:
    """(shape, series, seconds) of every first call and last warm call of one image measured, for the chart."""
    points = []
    for p in snapshot.pipelines:
        for s in (s for s in p.shapes if s.batch == 1):
            if s.first_call_seconds is not None:
                points.append((str(s.shape), f"{p.key.mode} first call", s.first_call_seconds))
            if s.last_latency is not None:
                points.append((str(s.shape), f"{p.key.mode} warm", s.last_latency))
    return points


def latency_chart(points: list[tuple[str, str, float]]):
    """First-call vs warm latency per shape, on a log axis: an 80 s first call and 50 ms warm calls both show."""
    from matplotlib.figure import Figure  # the object API: safe to draw from the server's threads
    from matplotlib.ticker import FuncFormatter, LogLocator

    shapes = sorted({shape for shape, _, _ in points}, key=lambda t: tuple(map(int, t.split("x"))))
    figure = Figure(figsize=(7, 2.8), dpi=100, layout="constrained")
    axes = figure.add_subplot()
    colors = series_colors()
    for series in colors:
        mine = [(shapes.index(shape), seconds) for shape, name, seconds in points if name == series]
        if mine:
            axes.scatter(*zip(*mine), color=colors[series], label=series, s=36, zorder=3)
    axes.set_yscale("log")
    # Plain seconds at 1, 2 and 5 of every decade (0.05, 0.1, 0.2, ... 50), not powers of ten.
    axes.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    axes.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axes.yaxis.set_minor_formatter(FuncFormatter(lambda value, _: ""))
    axes.set_xticks(range(len(shapes)), shapes)
    axes.set_xlim(-0.5, max(len(shapes), 1) - 0.5)
    axes.set_ylabel("seconds (log)")
    axes.set_title("First call vs warm latency", fontsize=10)
    axes.grid(True, which="both", axis="y", alpha=0.3)
    if points:
        axes.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return figure


def hardware_choices(description: Description) -> list[tuple[str, str]]:
    return [(f"{h.name} — {'found: ' if h.available else 'unavailable: '}{h.reason}", h.name)
            for h in description.hardware]


def option_notes(offer: Offer) -> str:
    """Which modes work for this model and hardware, why the others do not, and the proposed placement."""
    if not offer.available:
        return f"**{offer.hardware} is unavailable:** {offer.reason}"
    proposal = offer.proposal
    lines = [f"- `{o.name}`: {o.reason}" if o.ok else f"- ~~`{o.name}`~~ not here: {o.reason}" for o in offer.modes]
    return "\n".join([f"**Proposed placement:** `{proposal.placement}`"
                      + (f" × {proposal.tp_size}" if proposal.placement is Placement.TP else "")
                      + f" — {proposal.reason}; up to {proposal.batch} waiting request(s) drawn together per call",
                      *lines])


def tp_size_choices(offer: Offer) -> dict:
    """The tensor-parallel sizes the engine accepts for this model here (TPU: its generation's) and the one chosen:
    the proposal's when it is one of them."""
    choices = list(offer.tp_sizes)
    proposal = offer.proposal.tp_size if offer.proposal and choices else None
    return {"choices": choices, "value": proposal if proposal in choices else next(iter(choices), None)}


def style_choices(model: ModelView) -> list[str]:
    """The LoRA styles the page offers for a model: none, then the model's own."""
    return [NO_STYLE, *(style["name"] for style in model.loras)]


def step_cache_choices(model: ModelView) -> list[str]:
    """The step caches the page offers for a model: none, auto, then those it has a preset for."""
    return [NO_CACHE, AUTO_CACHE, *(c["name"] for c in model.step_caches if not c["refused"])]


def describe_comparison(comparison: Comparison) -> str:
    """The comparison's figures as a table a person reads beside the two images."""
    facts = comparison.facts()
    a, b = facts["sides"]

    def seconds(value) -> str:
        return "—" if value is None else f"{value:.3f}"

    def calls(side) -> str:
        cache = side["step_cache"]
        return f"{cache['calls']} ({cache['skipped']} from {cache['ran']})" if cache["ran"] != "none" else \
            str(cache["calls"])

    rows = [("configuration", a["configuration"], b["configuration"]),
            ("total s", seconds(a["total_seconds"]), seconds(b["total_seconds"])),
            ("load s", seconds(a["load_seconds"]), seconds(b["load_seconds"])),
            ("compile s", seconds(a["compile_seconds"]), seconds(b["compile_seconds"])),
            ("denoise s", seconds(a["denoise_seconds"]), seconds(b["denoise_seconds"])),
            ("transformer calls", calls(a), calls(b)),
            ("weights MB", f"{a['weight_bytes'] / 1e6:.2f}", f"{b['weight_bytes'] / 1e6:.2f}")]
    speed = "n/a" if facts["speedup"] is None else f"**{facts['speedup']:.2f}×** total"
    if facts["denoise_speedup"] is not None:
        speed += f", **{facts['denoise_speedup']:.2f}×** denoise"
    apart = "identical pictures" if facts["identical"] else \
        f"mean |A−B| **{facts['mean_abs_difference']:.2f}**/255, PSNR **{facts['psnr_db']:.1f} dB**"
    table = "\n".join(["| | A | B |", "|---|---|---|", *(f"| {label} | {x} | {y} |" for label, x, y in rows)])
    return (f"{facts['model']} · {facts['size']} · seed {facts['seed']}  \n{table}\n\n"
            f"B's speed ÷ A's: {speed} · {apart}")


def describe_plan(engine: Engine, model, host) -> str:
    """The model on another host, as the planner answers (`python -m acceldemo plan`)."""
    if not host:
        return ""
    try:
        planned = engine.plan(model, host)
    except (AcceldemoError, ValueError) as error:
        return str(error)
    head, *rest = planned.lines()
    return f"**{head}**  \n" + "  \n".join(line.strip() for line in rest) + f"  \n_{planned.source}_"


def strength_use(model: ModelView) -> dict:
    """The edit strength slider as it applies to a model: image-to-image uses it, reference images do not."""
    if model.edits == EditMethod.STRENGTH:
        return {"interactive": True, "info": "how much of the picture is redrawn: 1 redraws all of it"}
    return {"interactive": False, "info": f"not used: {model.title} edits with reference images (the picture guides "
                                          "what the prompt draws)"}


class Handlers:
    """What the page's events do: each turns the page's values into one engine call (off the event loop where it
    works: checking decodes pictures, a file is written) and its result, or its error, back."""

    def __init__(self, engine: Engine, catalog: dict[str, ModelView], keys: Keys | None = None):
        self.engine, self.catalog, self.keys = engine, catalog, keys or Keys()
        self.outputs = Path(tempfile.mkdtemp(prefix="page-", dir=os.environ.get("GRADIO_TEMP_DIR")))
        # The running job of each browser session: Stop ends it at its next denoise step.
        self.running: dict[str, WatchedJob] = {}

    def offer(self, model, hardware, placement=None) -> Offer | str:
        try:
            return self.engine.offer(model, hardware, None if placement in (None, AUTO) else Placement(placement))
        except (AcceldemoError, ValueError) as error:
            return str(error)

    async def image_file(self, image) -> str:
        return await asyncio.to_thread(image_file, image, self.outputs)

    async def follow(self, submit, progress: gr.Progress):
        """A job to its end, its progress shown; the engine's refusal or error as the page's message."""
        try:
            job = WatchedJob(submit)
            async for event in job.events():
                _show(progress, event)
            return await job.result()
        except AcceldemoError as error:
            raise gr.Error(str(error), print_exception=False) from None

    # The edit and style inputs come last and have defaults: gradio_client callers that send the first ten values
    # positionally keep working.
    async def generate(self, prompt, model, hardware, mode, placement, tp_size, resolution, steps, guidance, seed,
                       picture=None, strength=DEFAULT_STRENGTH, lora=NO_STYLE, lora_scale=1.0,
                       step_cache=NO_CACHE, quantization=str(Quantization.NONE),
                       session: gr.Request = None, progress=gr.Progress()):
        """The image forming in place: each preview as it comes (of the first image), then the image and its facts."""
        params = _params(prompt, model, hardware, mode, placement, tp_size, resolution, steps, guidance, seed,
                         previews=True, picture=picture, strength=strength, lora=lora, lora_scale=lora_scale,
                         step_cache=step_cache, quantization=quantization)
        try:
            request = await asyncio.to_thread(self.engine.check, params)
            client = self.client(session)
            token = visitor_token(getattr(session, "headers", None))
            job = self.running[session.session_hash] = WatchedJob(
                lambda report: self.engine.submit(request, report, client=client, visitor_token=token))
            try:
                async for event in job.events():
                    _show(progress, event)
                    if event.preview is not None and event.image == 0:
                        yield await self.image_file(event.preview.image()), gr.skip(), gr.skip()
                result = await job.result()
            finally:
                job.cancel()  # a no-op once it ended; stops it when the page went away or Stop cancelled the event
                self.running.pop(session.session_hash, None)
        except AcceldemoError as error:
            raise gr.Error(str(error), print_exception=False) from None
        yield await self.image_file(result.image), describe_result(result), result.facts()

    async def example(self, prompt, model, progress=gr.Progress()):
        """An example of an embedded model as the page's defaults draw it (eager, here, its default size, seed 0):
        drawn at its first click, then answered from Gradio's example cache."""
        request = await asyncio.to_thread(self.engine.check, GenerateParams(prompt=prompt, model=model, seed=0))
        result = await self.follow(lambda report: self.engine.submit(request, report), progress)
        return await self.image_file(result.image), describe_result(result)

    async def compare(self, prompt, model, resolution, seed, *sides, progress=gr.Progress()):
        """Two configurations of one prompt and seed, the first drawn then the second: both images, the figures."""
        first, second = (_params(prompt, model, hardware, mode, placement, None, resolution, steps or None, None,
                                 seed, step_cache=step_cache, quantization=quantization)
                         for hardware, mode, placement, step_cache, quantization, steps in (sides[:6], sides[6:]))
        comparison = await self.follow(lambda report: self.engine.submit_comparison(first, second, report), progress)
        return (await self.image_file(comparison.first.image), await self.image_file(comparison.second.image),
                describe_comparison(comparison), comparison.facts())

    def stop(self, session: gr.Request):
        """Ends this session's running job; Generate comes back in the place of Stop."""
        job = self.running.get(session.session_hash)
        if job is not None:
            job.cancel()
        # `cancels` ends the event in the browser at once, so the engine's own message never reaches it.
        return (NOTHING_TO_STOP if job is None else STOPPED), *drawing(False)

    def operator(self, unlocked, session: gr.Request | None) -> bool:
        """Whether this event may take the operator's actions: no operator key is needed, this page was unlocked with
        it, or an API call carries it."""
        if unlocked is True or not self.keys.operator_required:
            return True
        caller = self.keys.known(session.headers.get("authorization") if session is not None else None)
        return caller is not None and caller.operator

    def client(self, session: gr.Request | None) -> str:
        """Whose turn in line an event takes: the key its API call carries, else its browser session."""
        caller = self.keys.known(session.headers.get("authorization") if session is not None else None)
        return client_name(caller, session=getattr(session, "session_hash", None),
                           peer=getattr(getattr(session, "client", None), "host", None))

    def unlock(self, key):
        """The operator key typed into the Operator tab: its panels shown (this session only), or a refusal."""
        if not self.keys.operator_key(key):
            return False, gr.skip(), gr.skip(), "", NOT_THE_OPERATOR_KEY
        return True, gr.update(visible=False), gr.update(visible=True), "", ""

    async def warm_up(self, shapes, model, hardware, mode, placement, tp_size, batches=("1",), unlocked=False,
                      session: gr.Request = None, progress=gr.Progress()):
        if not self.operator(unlocked, session):
            raise gr.Error(OPERATOR_ONLY.format(action="warming up shapes"), print_exception=False)
        if not shapes:
            raise gr.Error("choose at least one shape to warm up", print_exception=False)
        params = _params("warm-up", model, hardware, mode, placement, tp_size, None, None, None, None)
        sizes = [int(b) for b in batches or ("1",) if str(b).isdigit()]
        records = await self.follow(lambda report: self.engine.submit_warm_up(params, shapes, report, sizes), progress)
        return "Warmed: " + ", ".join(f"{r.shape}{f' ×{r.batch}' if r.batch > 1 else ''} ({r.state}, "
                                      f"{r.compile_seconds:.2f} s compile)" for r in records)

    def refresh_status(self, drawn, unlocked=False, session: gr.Request = None):
        """The panels; the chart is drawn again only when its points changed since this page last drew it. Nothing
        for a page that has not shown the operator key, where one is needed."""
        if not self.operator(unlocked, session):
            return (gr.skip(),) * 5
        snapshot = self.engine.snapshot()
        counters = snapshot.counters
        line = (f"Line: {snapshot.queue_depth} waiting (limit {snapshot.queue_limit}) · requests "
                + ", ".join(f"{outcome} {count}" for outcome, count in counters.requests.items())
                + f" · {counters.drawn} image(s) drawn in {counters.calls} pipeline call(s)")
        points = latency_points(snapshot)
        chart_update = gr.skip() if drawn == points else latency_chart(points)
        return status_rows(snapshot), replica_rows(snapshot), chart_update, \
            f"Start-up warm-up: {snapshot.startup.shown}  \n{line}  \n{describe_packages(snapshot.precompiled)}", \
            points

    def notes_and_sizes(self, model, hardware, placement) -> tuple[str, dict]:
        found = self.offer(model, hardware, placement)
        if isinstance(found, str):
            return found, gr.update(choices=[], value=None)
        return option_notes(found), gr.update(**tp_size_choices(found))

    def on_model(self, model, hardware, placement):
        """A model picked: its sizes, steps, guidance, styles, strength use and step caches everywhere they show."""
        spec = self.catalog.get(model)
        if spec is None:
            return (gr.skip(), gr.skip(), gr.skip(), *self.notes_and_sizes(model, hardware, placement),
                    *[gr.skip()] * 8)
        presets = [str(s) for s in spec.presets]
        caches = step_cache_choices(spec)
        return (gr.update(choices=presets, value=str(spec.default_size)), spec.steps, spec.guidance,
                *self.notes_and_sizes(model, hardware, placement),
                gr.update(choices=presets, value=[str(spec.default_size)]),
                gr.update(choices=style_choices(spec), value=NO_STYLE), gr.update(**strength_use(spec)),
                gr.update(choices=caches, value=NO_CACHE), gr.update(choices=caches, value=NO_CACHE),
                gr.update(choices=caches, value=AUTO_CACHE if AUTO_CACHE in caches else NO_CACHE), spec.steps,
                spec.steps)


def drawing(busy: bool) -> tuple[dict, dict]:
    """Generate and Stop as a draw starts (Stop in Generate's place) and ends (Generate back)."""
    return gr.update(visible=not busy), gr.update(visible=busy)


def mode_choices() -> list[str]:
    return [str(m) for m in all_modes()]


def draw_controls(on: Handlers, description: Description, r: SimpleNamespace) -> SimpleNamespace:
    """The first screen's left side: the prompt with Generate (Stop in its place while drawing) and the examples
    right under it, the four choices people change most, then Advanced and the edit/style inputs folded away."""
    default, default_hw, c = description.model(description.default_model), description.default_hardware, \
        SimpleNamespace()
    # Made first and placed below: the examples right under the prompt pick the model.
    c.model = gr.Dropdown([(m.title, m.name) for m in description.models], value=default.name, label="Model",
                          elem_id="model", min_width=160, render=False)
    with gr.Row(equal_height=False, elem_id="prompt-row"):
        c.prompt = gr.Textbox(label="Prompt (Enter draws)", value="a red circle on a blue background, top left",
                              lines=1, max_lines=4, elem_id="prompt", scale=4, min_width=180)
        c.run = gr.Button("Generate", variant="primary", elem_id="generate", scale=1, min_width=110)
        c.stop = gr.Button("Stop", variant="stop", elem_id="stop", scale=1, min_width=110, visible=False)
    example_lists(on, description, c, r)
    with gr.Row():
        c.model.render()
        c.hardware = gr.Dropdown(hardware_choices(description), value=default_hw, label="Hardware",
                                 elem_id="hardware", min_width=160)
        c.mode = gr.Dropdown(mode_choices(), value=mode_choices()[0], label="Mode", elem_id="mode", min_width=120)
        # The model's presets; a typed size reaches the engine, which says why it is refused.
        c.resolution = gr.Dropdown([str(s) for s in default.presets], value=str(default.default_size),
                                   allow_custom_value=True, label="Resolution (WxH, presets or typed)",
                                   elem_id="resolution", min_width=120)
    with gr.Accordion("Advanced", open=False, elem_id="advanced"):
        with gr.Row():
            # Any typed name reaches the engine, which says why a cache is refused for a model or mode.
            c.step_cache = gr.Dropdown(step_cache_choices(default), value=NO_CACHE, allow_custom_value=True,
                                       label="Step cache (reuse work across steps)", elem_id="step-cache")
            c.quantization = gr.Dropdown([str(q) for q in Quantization], value=str(Quantization.NONE),
                                         label="Weights", elem_id="quantization")
        with gr.Row():
            c.steps = gr.Number(default.steps, label="Steps", precision=0, elem_id="steps", min_width=90)
            c.guidance = gr.Number(default.guidance, label="Guidance", elem_id="guidance", min_width=90)
            c.seed = gr.Number(0, label="Seed", precision=0, elem_id="seed", min_width=90)
            c.dice = gr.Button("Random seed", size="sm", min_width=90)
    with gr.Accordion("Edit a picture, or draw in a style", open=False, elem_id="edit-style") as c.edit_fold:
        c.picture = picture_upload(label="Picture to edit (optional)", type="pil", format="png",
                                   sources=["upload", "clipboard"], height=192, elem_id="picture")
        c.strength = gr.Slider(0.05, 1, value=DEFAULT_STRENGTH, step=0.05, label="Edit strength",
                               elem_id="strength", **strength_use(default))
        with gr.Row():
            # Any typed name reaches the engine, which names the styles a model offers: an API caller may ask for
            # another model's style than the first model's listed here.
            c.lora = gr.Dropdown(style_choices(default), value=NO_STYLE, allow_custom_value=True,
                                 label="Style (LoRA)", elem_id="lora")
            c.lora_scale = gr.Slider(0, 2, value=1.0, step=0.05, label="Style strength", elem_id="lora-scale")
    return c


def result_panel() -> SimpleNamespace:
    """The first screen's right side: the picture (display-only, with download and full screen), its facts with the
    timing line first, and Edit this. Made before they are placed (`render`), as the examples draw into them."""
    r = SimpleNamespace()
    r.image = gr.Image(label="Image", type="pil", format="png", elem_id="image", height=384, interactive=False,
                       buttons=["download", "fullscreen"], render=False)
    r.facts = gr.Markdown(elem_id="facts", render=False)
    r.edit = gr.Button("Edit this", size="sm", elem_id="edit-this", render=False)
    r.facts_json = gr.JSON(label="Facts (JSON)", visible=False, render=False)
    return r


def compare_tab(description: Description, default: ModelView, default_hw: str) -> SimpleNamespace:
    """Compare: the prompt, model, resolution and seed of the first tab under two configurations."""
    c = SimpleNamespace(sides=[])
    gr.Markdown("The prompt, model, resolution and seed of the Generate tab, drawn under A, then under B, on the same "
                "line as every request: both pictures, their times, B's speed against A's and how far apart the "
                "pictures are.")
    with gr.Row():
        for side in ("a", "b"):
            with gr.Column(min_width=280):
                gr.Markdown(f"**{side.upper()}**")
                c.sides += [
                    gr.Dropdown(hardware_choices(description), value=default_hw, label="Hardware",
                                elem_id=f"compare-{side}-hardware"),
                    gr.Dropdown(mode_choices(), value=mode_choices()[0], label="Mode", elem_id=f"compare-{side}-mode"),
                    gr.Dropdown([AUTO, *map(str, Placement)], value=AUTO, label="Placement",
                                elem_id=f"compare-{side}-placement"),
                    gr.Dropdown(step_cache_choices(default), value=NO_CACHE if side == "a" else AUTO_CACHE,
                                allow_custom_value=True, label="Step cache", elem_id=f"compare-{side}-step-cache"),
                    gr.Dropdown([str(q) for q in Quantization], value=str(Quantization.NONE), label="Weights",
                                elem_id=f"compare-{side}-quantization"),
                    gr.Number(default.steps, label="Steps", precision=0, elem_id=f"compare-{side}-steps")]
    c.button = gr.Button("Compare", variant="primary", elem_id="compare")
    with gr.Row():
        c.a = gr.Image(label="A", type="pil", format="png", elem_id="compare-a-image", height=256, interactive=False)
        c.b = gr.Image(label="B", type="pil", format="png", elem_id="compare-b-image", height=256, interactive=False)
    c.facts = gr.Markdown(elem_id="compare-facts")
    c.json = gr.JSON(label="Comparison (JSON)", visible=False)
    return c


def operator_tab(default: ModelView, first_offer: Offer | str, locked: bool = False) -> SimpleNamespace:
    """The operator's view: placement, warm-up, the start-up warm-up and the line, replicas, compiled shapes and the
    latency chart. `locked` (an operator key is set): warm-up and the panels stay hidden until the key is typed."""
    o = SimpleNamespace()
    o.unlocked = gr.State(False)  # kept on the server, per browser session: a page cannot set it itself
    with gr.Row(visible=locked, elem_id="operator-lock") as o.lock:
        o.key = gr.Textbox(type="password", label="Operator key", info="warm-up and the panels below are the "
                           "operator's: ACCELDEMO_ADMIN_KEY", elem_id="operator-key", scale=3)
        o.unlock = gr.Button("Unlock", elem_id="unlock", scale=1)
        o.lock_note = gr.Markdown(elem_id="operator-lock-note")
    with gr.Row():
        o.placement = gr.Dropdown([AUTO, *map(str, Placement)], value=AUTO, label="Placement", elem_id="placement")
        # Any typed size reaches the engine, which says why it is refused; the list is what works here.
        o.tp_size = gr.Dropdown(label="Degree (tp: its sizes here; cp: typed)", allow_custom_value=True,
                                elem_id="tp-size", **(tp_size_choices(first_offer) if isinstance(first_offer, Offer)
                                                      else {"choices": []}))
        o.other_host = gr.Dropdown(["", *host_kinds()], value="", label="On another host",
                                   info="what this model would get there (python -m acceldemo plan)",
                                   elem_id="other-host")
    o.other_plan = gr.Markdown(elem_id="other-host-plan")
    o.notes = gr.Markdown(option_notes(first_offer) if isinstance(first_offer, Offer) else first_offer,
                          elem_id="mode-notes")
    with gr.Column(visible=not locked, elem_id="operator-panels") as o.panels:
        operator_panels(o, default)
    return o


def operator_panels(o: SimpleNamespace, default: ModelView) -> None:
    """Warm-up, the start-up warm-up and the line, replicas, compiled shapes and the latency chart."""
    with gr.Accordion("Warm-up", open=True, elem_id="warm-up"):
        default_presets = [str(s) for s in default.presets]
        o.warm_shapes = gr.CheckboxGroup(default_presets, value=[str(default.default_size)], label="Shapes to compile")
        o.warm_batches = gr.CheckboxGroup([str(b) for b in BUCKETS], value=["1"],
                                          label="Batch sizes (waiting requests drawn together in one call)")
        o.warm_button = gr.Button("Warm up these shapes", elem_id="warmup")
        o.warm_result = gr.Markdown()
    o.startup = gr.Markdown(elem_id="startup")
    gr.Markdown("### Replicas")
    o.replicas = gr.Dataframe(headers=REPLICA_COLUMNS, interactive=False, elem_id="replicas")
    gr.Markdown("### Compiled shapes")
    o.shapes = gr.Dataframe(headers=STATUS_COLUMNS, interactive=False, elem_id="shapes")
    o.chart = gr.Plot(format="png", show_label=False, elem_id="latency")


def build_page(engine: Engine, keys: Keys | None = None) -> gr.Blocks:
    """The page over one engine: its description fills the selectors, its snapshot the panels. The first screen is
    the prompt, Generate and the picture; Compare and the operator's view are tabs of their own."""
    description = engine.describe()
    default = description.model(description.default_model)
    on = Handlers(engine, {m.name: m for m in description.models}, keys)
    first_offer = on.offer(default.name, description.default_hardware)
    # Served images are files in Gradio's cache: delete those older than an hour, every 10 minutes.
    with gr.Blocks(title="acceldemo", delete_cache=(600, 3600)) as page:
        gr.Markdown("## acceldemo\nDiffusion on accelerators, with the compile cost in plain sight.", elem_id="title")
        with gr.Tabs(elem_id="tabs"):
            with gr.Tab("Generate", id="generate-tab", elem_id="generate-tab"):
                r = result_panel()
                with gr.Row(equal_height=False):
                    with gr.Column(scale=1, min_width=320):
                        c = draw_controls(on, description, r)
                    with gr.Column(scale=1, min_width=320):
                        for shown in (r.image, r.facts, r.edit, r.facts_json):
                            shown.render()
            with gr.Tab("Compare", id="compare-tab", elem_id="compare-section"):
                k = compare_tab(description, default, description.default_hardware)
            with gr.Tab("Operator", id="operator-tab", elem_id="operator-tab"):
                o = operator_tab(default, first_offer, locked=on.keys.operator_required)
        wire(page, on, c, r, k, o)
    return page


def example_lists(on: Handlers, description: Description, c: SimpleNamespace, r: SimpleNamespace) -> None:
    """Each model's example prompts: a click fills the prompt and picks the model; an embedded model's example is
    drawn at its first click and answered from Gradio's example cache after."""
    for spec in (spec for spec in description.models if spec.example_prompts):
        embedded = spec.repo is None
        gr.Examples([[text, spec.name] for text in spec.example_prompts], [c.prompt, c.model],
                    label=f"Prompts {spec.name} knows", elem_id=f"examples-{spec.name}", visible_columns=[0],
                    **({"fn": on.example, "outputs": [r.image, r.facts], "cache_examples": True, "cache_mode": "lazy"}
                       if embedded else {}))


def wire(page: gr.Blocks, on: Handlers, c: SimpleNamespace, r: SimpleNamespace, k: SimpleNamespace,
         o: SimpleNamespace) -> None:
    """The page's events: each control to its handler."""
    private = {"queue": False, "api_visibility": "private"}
    inputs = [c.prompt, c.model, c.hardware, c.mode, o.placement, o.tp_size, c.resolution, c.steps, c.guidance, c.seed,
              c.picture, c.strength, c.lora, c.lora_scale, c.step_cache, c.quantization]
    started = gr.on([c.run.click, c.prompt.submit], lambda: drawing(True), None, [c.run, c.stop], **private)
    generating = started.then(on.generate, inputs, [r.image, r.facts, r.facts_json], api_name="generate",
                              concurrency_id="device")
    for ended in (generating.then, generating.failure):  # Gradio's `then` does not follow a raised gr.Error
        ended(lambda: drawing(False), None, [c.run, c.stop], **private)
    c.stop.click(on.stop, None, [r.facts, c.run, c.stop], cancels=[generating], **private)
    # The image just drawn as the picture to edit, its fold opened (nothing drawn yet: the picture stays).
    r.edit.click(lambda drawn: (gr.skip(), gr.skip()) if drawn is None else (drawn, gr.update(open=True)), r.image,
                 [c.picture, c.edit_fold], **private)
    k.button.click(on.compare, [c.prompt, c.model, c.resolution, c.seed, *k.sides], [k.a, k.b, k.facts, k.json],
                   api_name="compare", concurrency_id="device")
    o.warm_button.click(on.warm_up, [o.warm_shapes, c.model, c.hardware, c.mode, o.placement, o.tp_size,
                                     o.warm_batches, o.unlocked], o.warm_result, api_name="warm_up",
                        concurrency_id="device")
    drawn = gr.State(None)  # the chart's points as this page last drew them
    panels = [o.shapes, o.replicas, o.chart, o.startup, drawn]
    gr.Timer(2.0).tick(on.refresh_status, [drawn, o.unlocked], panels, **private)
    page.load(on.refresh_status, [drawn, o.unlocked], panels, **private)
    gr.on([o.unlock.click, o.key.submit], on.unlock, o.key, [o.unlocked, o.lock, o.panels, o.key, o.lock_note],
         **private)

    c.dice.click(lambda: random.randint(0, 2**31 - 1), None, c.seed, **private)
    c.model.change(on.on_model, [c.model, c.hardware, o.placement],
                   [c.resolution, c.steps, c.guidance, o.notes, o.tp_size, o.warm_shapes, c.lora, c.strength,
                    c.step_cache, k.sides[3], k.sides[9], k.sides[5], k.sides[11]], **private)
    c.hardware.change(on.notes_and_sizes, [c.model, c.hardware, o.placement], [o.notes, o.tp_size], **private)
    o.placement.change(lambda *values: on.notes_and_sizes(*values)[0], [c.model, c.hardware, o.placement], o.notes,
                       **private)
    for changed in (o.other_host, c.model):
        changed.change(lambda model, host: describe_plan(on.engine, model, host), [c.model, o.other_host],
                       o.other_plan, **private)
