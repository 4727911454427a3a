"""The benchmark report: one JSON file, a markdown table and a PNG chart of the ratios, written side by side."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .figures import Figure

JSON_NAME, MARKDOWN_NAME, CHART_NAME = "bench.json", "bench.md", "bench.png"


@dataclass
class BenchReport:
    """Everything one run measured, with what it ran on and the sections that failed (and why)."""

    command: str
    plan: str
    backend: str
    seconds: float
    environment: dict
    notes: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    figures: list[Figure] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"command": self.command, "plan": self.plan, "backend": self.backend, "seconds": self.seconds,
                "environment": self.environment, "notes": self.notes, "failures": self.failures,
                "figures": [f.as_dict() for f in self.figures]}

    def figure(self, key: str) -> Figure:
        return next(f for f in self.figures if f.key == key)


def _met(figure: Figure) -> str:
    return {True: "yes", False: "**no**", None: ""}[figure.met]


def markdown(report: BenchReport) -> str:
    """The table the README's Performance section shows, with the command, the machine and the misses explained."""
    env = report.environment
    lines = [
        f"`{report.command}` — plan `{report.plan}`, in-process compile backend `{report.backend}`, "
        f"{env['hardware']}, torch {env['torch']}, diffusers {env['diffusers']}, {env['cpu_cores']} cores "
        f"(torch threads {env['torch_threads']}, load average {env['load_average']:.1f} at start), "
        f"{report.seconds:.0f} s.",
        "",
        "| § | figure | median (min–max) | runs | target | met | note |",
        "|---|---|---|---|---|---|---|",
    ]
    for f in report.figures:
        value = str(f.value) if f.value is not None else "not measured"
        unit = "" if f.unit == "ratio" or f.value is None else f" {f.unit}"
        runs = f.value.runs if f.value is not None else ""
        lines.append(f"| {f.section} | {f.title} | {value}{unit} | {runs} | {f.target or ''} | {_met(f)} | "
                     f"{f.note.replace('|', '/')} |")
    missed = [f for f in report.figures if f.met is False]
    if missed:
        lines += ["", "Missed targets:"]
        lines += [f"- {f.title}: {f.if_missed or 'no explanation recorded'}" for f in missed]
    if report.notes or report.failures:
        lines += ["", "Notes:"]
        lines += [f"- {note}" for note in report.notes]
        lines += [f"- section failed — {failure}" for failure in report.failures]
    return "\n".join(lines) + "\n"


def chart(report: BenchReport, path: Path) -> None:
    """Every ratio as a bar with its min–max and its target, on a log scale (ratios span 0.05 to 10)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [f for f in report.figures if f.unit == "ratio" and f.value is not None]
    fig, ax = plt.subplots(figsize=(12, 0.45 * len(shown) + 1.8))
    ys = range(len(shown))
    medians = [f.value.median for f in shown]
    errors = [[f.value.median - f.value.low for f in shown], [f.value.high - f.value.median for f in shown]]
    colours = ["#999999" if f.met is None else "#2a9d8f" if f.met else "#e76f51" for f in shown]
    ax.barh(list(ys), medians, xerr=errors, color=colours, capsize=3)
    for y, f in zip(ys, shown):
        if f.target is not None:
            ax.plot([f.target.bound] * 2, [y - 0.4, y + 0.4], color="black", linewidth=2)
    ax.axvline(1.0, color="#444444", linestyle=":", linewidth=1)
    ax.set_xscale("log")
    ax.set_yticks(list(ys), [_short(f"§{f.section} {f.title}", 64) for f in shown], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ratio, log scale: bar = median, whisker = min–max, black tick = target", fontsize=8)
    ax.set_title(f"{report.command}  ({report.plan}, backend {report.backend})\n"
                 "green: target met · red: missed · grey: no target", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def _short(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 1] + "…"


def write_report(report: BenchReport, out: Path) -> dict[str, Path]:
    """The JSON, markdown and PNG files in `out` (made if missing); their paths by kind."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / JSON_NAME, "markdown": out / MARKDOWN_NAME, "chart": out / CHART_NAME}
    paths["json"].write_text(json.dumps(report.as_dict(), indent=2) + "\n")
    paths["markdown"].write_text(markdown(report))
    chart(report, paths["chart"])
    return paths
