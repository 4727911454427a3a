"""The Gradio page: components and events; each handler is one engine call and its translation."""
from __future__ import annotations

import contextlib
import logging
import os
import random
import tempfile
import threading
import time
from pathlib import Path

import gradio as gr
import pandas as pd

from ..engine import (PLACEMENTS, SessionManager, mode_options, parse_resolution, propose_placement,
                      tensor_parallel_options)
from ..errors import AcceldemoError
from ..hardware import all_modes, best_available, detect_all, get_hardware
from ..models.catalog import CATALOG, get_model
from ..records import GenerateRequest, GenerateResult, Progress

log = logging.getLogger("acceldemo.ui")
AUTO = "auto"
STATUS_COLUMNS = ["pipeline", "resident", "shape", "state", "compile s", "graphs", "hits", "first call s",
                  "last warm s", "reason"]
REPLICA_COLUMNS = ["replica", "state", "waiting", "shapes held", "served", "last latency s", "restarts", "devices"]
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


def _request(prompt, model, hardware, mode, placement, tp_size, resolution, steps, guidance, seed) -> GenerateRequest:
    return GenerateRequest(prompt=prompt, model=model, hardware=hardware, mode=mode,
                           placement=None if placement in (None, AUTO) else placement,
                           tp_size=tp_size if placement == "tp" else None, resolution=resolution, steps=steps,
                           guidance=guidance, seed=seed)


def _progress_to_gradio(progress: gr.Progress):
    def report(event: Progress) -> None:
        # Gradio hides the text with the bar when the fraction is None, so phases without steps show 0.
        fraction = event.step / event.total if event.step and event.total else 0.0
        progress(fraction, desc=event.message if event.phase != "denoise" else f"denoise {event.message}")
    return report


def image_file(image, folder: Path) -> str:
    """The image as a PNG file of its own, for Gradio to copy into its cache.

    Gradio keeps a returned PIL image at a path named by its content and rewrites that file in place on every
    return, so two people asking the same prompt and seed at once can download it half-written (seen in bench §7:
    "peer closed connection without sending complete message body"). A returned file is copied in under a
    temporary name and renamed. Gradio copies it as the event ends, so files older than a minute are done with.
    """
    for old in folder.glob("*.png"):
        with contextlib.suppress(FileNotFoundError):
            if time.time() - old.stat().st_mtime > 60:
                old.unlink()
    fd, path = tempfile.mkstemp(suffix=".png", dir=folder)
    with os.fdopen(fd, "wb") as out:
        image.save(out, format="png")
    return path


def describe_result(result: GenerateResult) -> str:
    """The facts a person reads beside the image."""
    r = result.request
    reuse = "reused a compiled graph" if result.warm else (
        f"first visit: {result.new_graphs} graph(s) compiled" if result.new_graphs else
        f"first visit: {result.compile_cache_hits} saved compile artifact(s) reused" if result.compile_cache_hits
        else "first visit to this shape")
    return (f"**{r.width}x{r.height}** · {r.model} · {result.key.devices} · {r.mode} · {r.placement}  \n"
            f"total **{result.seconds:.3f} s** · compile {result.compile_seconds:.2f} s · load "
            f"{result.load_seconds:.2f} s · queue wait {result.queue_wait:.2f} s  \n"
            f"{reuse} · graphs added: {result.new_graphs} · steps {r.steps} · seed {r.seed}"
            + (f"  \n**{result.note}**" if result.note else ""))


def describe_packages(store: dict) -> str:
    """One line on the saved compiled transformers that let a restart skip compiling (mode compiled, CPU/CUDA)."""
    if store["setting"] == "off":
        return "Precompiled packages: off (ACCELDEMO_PRECOMPILE=off)"
    rate = "" if store["hit_rate"] is None else f", {store['hit_rate']:.0%} of first visits loaded one"
    return (f"Precompiled packages: {store['packages']} on disk ({store['megabytes']} MB); since start "
            f"{store['built']} built, {store['loaded']} loaded{rate}")


def status_rows(manager: SessionManager) -> pd.DataFrame:
    rows = []
    for p in manager.status():
        for s in p.shapes or ():
            rows.append([str(p.key), "yes" if p.resident else "evicted", str(s.shape), s.state,
                         round(s.compile_seconds, 2), s.graphs, s.hits,
                         None if s.first_call_seconds is None else round(s.first_call_seconds, 3),
                         None if s.last_latency is None else round(s.last_latency, 3), s.reason])
    return pd.DataFrame(rows, columns=STATUS_COLUMNS)


def replica_rows(manager: SessionManager) -> pd.DataFrame:
    """Each replica: its devices, what it is doing, who waits for it, what it holds and has served."""
    devices = {(d.device.hardware, d.device.index): d.device for d in manager.devices()}
    rows = []
    for r in manager.replicas():
        held = [devices.get((r.devices.hardware, i)) for i in r.devices.indices]
        rows.append([str(r.devices), r.state, r.waiting, " ".join(r.shapes), r.served,
                     None if r.last_latency is None else round(r.last_latency, 3), r.restarts,
                     "; ".join(f"{d} {d.memory_bytes / 1e9:.1f} GB {d.detail}".strip() for d in held if d)])
    return pd.DataFrame(rows, columns=REPLICA_COLUMNS)


def latency_points(manager: SessionManager) -> list[tuple[str, str, float]]:
    """(shape, series, seconds) of every first call and last warm call measured, for the chart."""
    points = []
    for p in manager.status():
        for s in p.shapes:
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


def status_json(manager: SessionManager, startup: dict) -> dict:
    """What the engine holds, for the API and /status: devices, the line, counters, pipelines and their shapes."""
    return {
        "startup_warmup": startup.get("state", "none configured"),
        "queue_depth": manager.queue_depth(),
        "queue_limit": manager.settings.queue_size,
        "counters": manager.counters(),
        "devices": [{"device": str(d.device), "hardware": d.device.hardware, "index": d.device.index,
                     "memory_gb": round(d.device.memory_bytes / 1e9, 1), "detail": d.device.detail,
                     "busy": d.running is not None, "running": d.running, "waiting": d.waiting,
                     "pipelines": list(d.pipelines)} for d in manager.devices()],
        "replicas": [{"devices": str(r.devices), "state": r.state, "waiting": r.waiting, "shapes": list(r.shapes),
                      "served": r.served, "last_latency": r.last_latency, "restarts": r.restarts,
                      "pipelines": list(r.pipelines)} for r in manager.replicas()],
        "precompiled": manager.precompiled(),
        "pipelines": [{"key": str(p.key), "model": p.key.model, "hardware": p.key.hardware,
                       "device": str(p.key.devices), "mode": p.key.mode,
                       "placement": p.key.placement, "tp_size": p.key.tp_size, "resident": p.resident,
                       "busy": p.busy, "load_seconds": round(p.load_seconds, 3),
                       "shapes": [{**s.__dict__, "shape": str(s.shape)} for s in p.shapes]}
                      for p in manager.status()],
    }


def hardware_choices() -> list[tuple[str, str]]:
    found = detect_all()
    return [(f"{n} — {'found: ' if a.available else 'unavailable: '}{a.reason}", n) for n, a in found.items()]


def option_notes(model: str, hardware: str, placement: str) -> str:
    """Which modes work for this model and hardware, why the others do not, and the proposed placement."""
    try:
        spec, hw = get_model(model), get_hardware(hardware)
    except AcceldemoError as error:
        return str(error)
    found = hw.detect()
    if not found.available:
        return f"**{hardware} is unavailable:** {found.reason}"
    proposal = propose_placement(spec, found, hw.tensor_parallel_sizes())
    lines = [f"- `{o.name}`: {o.reason}" if o.ok else f"- ~~`{o.name}`~~ not here: {o.reason}"
             for o in mode_options(spec, hw, None if placement == AUTO else placement)]
    return "\n".join([f"**Proposed placement:** `{proposal.name}`"
                      + (f" × {proposal.tp_size}" if proposal.name == "tp" else "") + f" — {proposal.reason}",
                      *lines])


def tp_size_choices(model: str, hardware: str, nodes: int) -> dict:
    """The tensor-parallel sizes the engine accepts for this model here (TPU: its generation's) and the one chosen:
    the proposal's when it is one of them."""
    try:
        spec, hw = get_model(model), get_hardware(hardware)
    except AcceldemoError:
        return {"choices": [], "value": None}
    choices = tensor_parallel_options(spec, hw, nodes) if hw.detect().available else []
    proposal = propose_placement(spec, hw.detect(), hw.tensor_parallel_sizes()).tp_size if choices else None
    return {"choices": choices, "value": proposal if proposal in choices else next(iter(choices), None)}


def build_page(manager: SessionManager, startup: dict) -> gr.Blocks:
    """The page; `startup` holds the start-up warm-up state the page shows."""
    default = get_model(manager.settings.default_model)
    default_hw = best_available()
    default_presets = [str(s) for s in default.presets]

    outputs = Path(tempfile.mkdtemp(prefix="page-", dir=os.environ.get("GRADIO_TEMP_DIR")))
    # Stop flags per browser session: Stop ends that session's job at its next denoise step.
    stops: dict[str, threading.Event] = {}

    def generate(prompt, model, hardware, mode, placement, tp_size, resolution, steps, guidance, seed,
                 session: gr.Request, progress=gr.Progress()):
        stop = stops[session.session_hash] = threading.Event()
        try:
            request = _request(prompt, model, hardware, mode, placement, tp_size, resolution, steps, guidance, seed)
            result = manager.generate(request, _progress_to_gradio(progress), cancelled=stop.is_set)
        except AcceldemoError as error:
            raise gr.Error(str(error), print_exception=False) from None
        finally:
            stops.pop(session.session_hash, None)
        return image_file(result.image, outputs), describe_result(result), result.facts()

    def stop_job(session: gr.Request) -> str:
        running = stops.get(session.session_hash)
        if running is None:
            return NOTHING_TO_STOP
        running.set()
        # `cancels` ends the event in the browser at once, so the engine's own message never reaches it.
        return STOPPED

    def warm_up(shapes, model, hardware, mode, placement, tp_size, progress=gr.Progress()):
        if not shapes:
            raise gr.Error("choose at least one shape to warm up", print_exception=False)
        try:
            base = _request("warm-up", model, hardware, mode, placement, tp_size, None, None, None, 0)
            records = manager.warm_up(base, [parse_resolution(s) for s in shapes], _progress_to_gradio(progress))
        except AcceldemoError as error:
            raise gr.Error(str(error), print_exception=False) from None
        return "Warmed: " + ", ".join(f"{r.shape} ({r.state}, {r.compile_seconds:.2f} s compile)" for r in records)

    def refresh_status(drawn):
        """The panels; the chart is drawn again only when its points changed since this page last drew it."""
        state = startup.get("state", "none configured")
        requests = manager.counters()["requests"]
        line = (f"Line: {manager.queue_depth()} waiting (limit {manager.settings.queue_size}) · requests "
                + ", ".join(f"{outcome} {count}" for outcome, count in requests.items()))
        points = latency_points(manager)
        chart_update = gr.skip() if drawn == points else latency_chart(points)
        return status_rows(manager), replica_rows(manager), chart_update, \
            f"Start-up warm-up: {state}  \n{line}  \n{describe_packages(manager.precompiled())}", points

    nodes = manager.settings.pool_nnodes

    def on_model(model, hardware, placement):
        spec = get_model(model)
        presets = [str(s) for s in spec.presets]
        return (gr.update(choices=presets, value=str(spec.default_shape)),
                spec.steps, spec.guidance, option_notes(model, hardware, placement),
                gr.update(**tp_size_choices(model, hardware, nodes)),
                gr.update(choices=presets, value=[str(spec.default_shape)]))

    def on_hardware(model, hardware, placement):
        return option_notes(model, hardware, placement), gr.update(**tp_size_choices(model, hardware, nodes))

    # Served images are files in Gradio's cache: delete those older than an hour, every 10 minutes.
    with gr.Blocks(title="acceldemo", delete_cache=(600, 3600)) as page:
        gr.Markdown("# acceldemo — diffusion on accelerators, with the compile cost in plain sight")
        with gr.Row():
            with gr.Column(scale=2):
                prompt = gr.Textbox(label="Prompt", value="a red circle on a blue background, top left", lines=2,
                                    elem_id="prompt")
                with gr.Row():
                    model = gr.Dropdown([(s.title, s.name) for s in CATALOG.values()], value=default.name,
                                        label="Model", elem_id="model")
                    hardware = gr.Dropdown(hardware_choices(), value=default_hw, label="Hardware",
                                           elem_id="hardware")
                    mode = gr.Dropdown(list(all_modes()), value="eager", label="Mode", elem_id="mode")
                    # The model's presets; a typed size reaches the engine, which says why it is refused.
                    resolution = gr.Dropdown(default_presets, value=str(default.default_shape),
                                             allow_custom_value=True, label="Resolution (WxH, presets or typed)",
                                             elem_id="resolution")
                with gr.Row():
                    steps = gr.Number(default.steps, label="Steps", precision=0, elem_id="steps")
                    guidance = gr.Number(default.guidance, label="Guidance", elem_id="guidance")
                    seed = gr.Number(0, label="Seed", precision=0, elem_id="seed")
                    dice = gr.Button("Random seed", size="sm")
                with gr.Accordion("Placement (advanced)", open=False):
                    with gr.Row():
                        placement = gr.Dropdown([AUTO, *PLACEMENTS], value=AUTO, label="Placement",
                                                elem_id="placement")
                        # Any typed size reaches the engine, which says why it is refused; the list is what works here.
                        tp_size = gr.Dropdown(label="TP world size", allow_custom_value=True, elem_id="tp-size",
                                              **tp_size_choices(default.name, default_hw, nodes))
                notes = gr.Markdown(option_notes(default.name, default_hw, AUTO), elem_id="mode-notes")
                with gr.Row():
                    run = gr.Button("Generate", variant="primary", elem_id="generate", scale=3)
                    stop_button = gr.Button("Stop", variant="stop", elem_id="stop", scale=1)
                for spec in CATALOG.values():
                    if spec.example_prompts:  # a click fills the prompt and picks the model it is for
                        gr.Examples([[text, spec.name] for text in spec.example_prompts], [prompt, model],
                                    label=f"Prompts {spec.name} knows", elem_id=f"examples-{spec.name}",
                                    visible_columns=[0])
            with gr.Column(scale=2):
                image = gr.Image(label="Image", type="pil", format="png", elem_id="image", height=384)
                facts = gr.Markdown(elem_id="facts")
                facts_json = gr.JSON(label="Facts (JSON)", visible=False)
        with gr.Accordion("Warm-up", open=False):
            warm_shapes = gr.CheckboxGroup(default_presets, value=[str(default.default_shape)],
                                           label="Shapes to compile")
            warm_button = gr.Button("Warm up these shapes", elem_id="warmup")
            warm_result = gr.Markdown()
        gr.Markdown("## Replicas")
        startup_text = gr.Markdown(elem_id="startup")
        replicas_table = gr.Dataframe(headers=REPLICA_COLUMNS, interactive=False, elem_id="replicas")
        gr.Markdown("## Compiled shapes")
        table = gr.Dataframe(headers=STATUS_COLUMNS, interactive=False, elem_id="shapes")
        chart = gr.Plot(format="png", show_label=False, elem_id="latency")
        timer = gr.Timer(2.0)

        inputs = [prompt, model, hardware, mode, placement, tp_size, resolution, steps, guidance, seed]
        generating = run.click(generate, inputs, [image, facts, facts_json], api_name="generate",
                               concurrency_id="device")
        stop_button.click(stop_job, None, facts, queue=False, cancels=[generating], api_visibility="private")
        warm_button.click(warm_up, [warm_shapes, model, hardware, mode, placement, tp_size], warm_result,
                          api_name="warm_up", concurrency_id="device")
        drawn = gr.State(None)  # the chart's points as this page last drew them
        panels = [table, replicas_table, chart, startup_text, drawn]
        timer.tick(refresh_status, drawn, panels, queue=False, api_visibility="private")
        page.load(refresh_status, drawn, panels, queue=False, api_visibility="private")

        def pipelines() -> dict:
            """Resident pipelines and their compiled shapes, as plain JSON."""
            return status_json(manager, startup)

        gr.api(pipelines, api_name="status", queue=False)
        dice.click(lambda: random.randint(0, 2**31 - 1), None, seed, queue=False, api_visibility="private")
        model.change(on_model, [model, hardware, placement], [resolution, steps, guidance, notes, tp_size, warm_shapes],
                     queue=False, api_visibility="private")
        hardware.change(on_hardware, [model, hardware, placement], [notes, tp_size], queue=False,
                        api_visibility="private")
        placement.change(option_notes, [model, hardware, placement], notes, queue=False, api_visibility="private")
    return page
