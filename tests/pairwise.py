"""Every pair of a request's choices, in as few requests as allpairspy finds (a covering array of strength 2): what
each case asks, and what it is compared with. `tests/test_pairwise.py` draws the engine's cases (those of the fleet
are planned, not drawn yet).

A case either draws the same picture as its reference — the same model, edit, step cache, weights and style, drawn
the plainest way: eager, on one device, alone, without previews — or is refused by the engine's check, before
anything loads, by an error that names one of the case's own choices."""
from __future__ import annotations

import dataclasses
import io
import itertools
from collections.abc import Callable
from dataclasses import dataclass

from allpairspy import AllPairs
from PIL import Image

from acceldemo.records import GenerateParams

PROMPT = "a red circle on a blue background, top left"
SIZE = 64
SEED = 11
# The choices, the plainest first (the reference's, where a choice is one of how a picture is drawn).
CHOICES = {
    "model": ("tiny-flux2-klein", "tiny-flux2", "tiny-flux1", "tiny-sd3", "tiny-shapes"),
    "placement": ("device", "offload", "tp", "cfg", "cp"),
    "edit": ("none", "image", "inpaint", "references"),
    "mode": ("eager", "compiled", "regional"),
    "step_cache": ("none", "taylorseer"),
    "quantization": ("none", "int8"),
    "style": ("none", "outline"),
    "batch": (1, 2),
    "previews": (False, True),
    "executor": ("engine", "fleet"),
}
# How a picture is drawn, not what it shows: the reference takes the first of each.
HOW = ("placement", "mode", "batch", "previews", "executor")
# The request field an error names → the choice it is about.
FIELDS = {"model": "model", "placement": "placement", "tp_size": "placement", "cp_size": "placement",
          "guidance": "placement", "image": "edit", "mask": "edit", "strength": "edit", "mode": "mode",
          "step_cache": "step_cache", "quantization": "quantization", "lora": "style", "num_images": "batch",
          "previews": "previews"}


@dataclass(frozen=True)
class Case:
    model: str
    placement: str
    edit: str
    mode: str
    step_cache: str
    quantization: str
    style: str
    batch: int
    previews: bool
    executor: str

    def __str__(self) -> str:
        return "-".join(str(getattr(self, name)) for name in CHOICES)

    def reference(self) -> Case:
        return Case(**{name: CHOICES[name][0] if name in HOW else getattr(self, name) for name in CHOICES})

    def params(self, seed: int = SEED) -> GenerateParams:
        images, mask = _edit(self.edit)
        return GenerateParams(
            prompt=PROMPT, model=self.model, hardware="cpu", mode=self.mode, placement=self.placement,
            resolution=f"{SIZE}x{SIZE}", seed=seed, num_images=self.batch, previews=self.previews, image=images,
            mask=mask, step_cache=self.step_cache, quantization=self.quantization, lora=self.style)

    def named(self, field: str | None) -> bool:
        """Whether an error about `field` is about one of this case's choices (not its plainest value)."""
        choice = FIELDS.get(field or "")
        return choice is not None and (choice == "model" or getattr(self, choice) != CHOICES[choice][0])


def pairs(case: Case) -> set[tuple[str, object, str, object]]:
    return {(a, getattr(case, a), b, getattr(case, b)) for a, b in itertools.combinations(CHOICES, 2)}


def every_pair() -> set[tuple[str, object, str, object]]:
    return {(a, x, b, y) for a, b in itertools.combinations(CHOICES, 2) for x in CHOICES[a] for y in CHOICES[b]}


def plainest(**choices) -> Case:
    return Case(**{name: choices.get(name, values[0]) for name, values in CHOICES.items()})


@dataclass(frozen=True)
class Plan:
    """`drawn`: cases the engine accepts, holding every pair that any accepted request can hold; `refused`: for each
    pair no accepted request holds, that pair with every other choice at its plainest."""

    drawn: list[Case]
    refused: list[Case]


def plan(accepts: Callable[[Case], bool]) -> Plan:
    """The covering array over the requests `accepts` takes: allpairspy's rows (it grows each row choice by choice,
    asking whether the row so far, the rest plainest, is accepted), then, since a filtered search can leave pairs
    out, one more case per pair still missing, grown greedily over the accepted requests; a pair no accepted request
    holds becomes a refusal case."""
    names = list(CHOICES)

    def acceptable(row: list) -> bool:
        return accepts(plainest(**dict(zip(names, row))))

    drawn = [Case(*row) for row in AllPairs(list(CHOICES.values()), filter_func=acceptable)]
    missing = every_pair() - set().union(*(pairs(case) for case in drawn))
    refused = []
    while missing:
        a, x, b, y = min(missing, key=str)
        case = plainest(**{a: x, b: y})
        if not accepts(case):
            refused.append(case)
            missing.discard((a, x, b, y))
            continue
        for name in names:  # each other choice: the value that holds the most missing pairs, still accepted
            if name in (a, b):
                continue
            options = [dataclasses.replace(case, **{name: value}) for value in CHOICES[name]]
            case = max((option for option in options if option == case or accepts(option)),
                       key=lambda option: len(pairs(option) & missing))
        drawn.append(case)
        missing -= pairs(case)
    return Plan(drawn, refused)


def _png(picture: Image.Image) -> bytes:
    out = io.BytesIO()
    picture.save(out, format="PNG")
    return out.getvalue()


def _picture(tint: int) -> bytes:
    """A picture to edit: a gradient with a square, not one colour."""
    picture = Image.linear_gradient("L").resize((SIZE, SIZE)).convert("RGB")
    picture.paste((tint, 40, 255 - tint), (8, 8, 40, 40))
    return _png(picture)


def _edit(edit: str) -> tuple[object, bytes | None]:
    """The pictures and mask an edit choice sends (OpenAI's mask: transparent where the picture changes)."""
    if edit == "none":
        return None, None
    if edit == "references":
        return [_picture(200), _picture(30)], None
    if edit == "image":
        return _picture(200), None
    mask = Image.new("RGBA", (SIZE, SIZE), (0, 0, 0, 255))
    mask.paste((0, 0, 0, 0), (0, 0, SIZE // 2, SIZE // 2))
    return _picture(200), _png(mask)

