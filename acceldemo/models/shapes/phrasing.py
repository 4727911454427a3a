"""The words tiny-shapes knows and the ways people phrase its captions; plain Python, so the catalog can read it.

A caption asks for a shape and, optionally, its colour, the background colour and a position.
Each phrasing family is a set of templates; the slots a template fills are the parts it asks
for, and whatever it leaves out the picture may show freely. The known vocabulary is every
word these templates and word lists can produce, and nothing else: the tokenizer gives these
words (in any letter case) their own tokens and spells every other word byte by byte.
"""
from __future__ import annotations

import random
import re
import string
from dataclasses import dataclass

COLOURS: tuple[str, ...] = ("red", "green", "blue", "yellow", "white", "black")
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
POSITIONS: tuple[str, ...] = ("top left", "top right", "bottom left", "bottom right", "center")

# Other spellings of a canonical word, the canonical one first.
SYNONYMS: dict[str, tuple[str, ...]] = {
    "circle": ("circle", "disc"),
    "center": ("center", "centre", "middle"),
    "top": ("top", "upper"),
    "bottom": ("bottom", "lower"),
}

# The canonical word of each spelling above (a word without synonyms is its own).
CANONICAL_WORD: dict[str, str] = {spelling: word for word, spellings in SYNONYMS.items() for spelling in spellings}

# {at_position} fills one of these with a position; "corner" only suits the four corners.
AT_POSITION: tuple[str, ...] = ("in the {}", "at the {}")
AT_CORNER: tuple[str, ...] = ("in the {} corner",)

# Slots: {colour} {shape} {background}; {position} bare ("top left"), {at_position} with its
# preposition ("in the top left corner"). A template asks for exactly the parts it has slots for.
FAMILIES: dict[str, tuple[str, ...]] = {
    "template": ("a {colour} {shape} on a {background} background, {position}",),
    "reworded": (
        "a {colour} {shape} on {background}, {position}",
        "{position}: a {colour} {shape} on a {background} background",
        "a {colour} {shape} {at_position} on a {background} background",
        "a {colour} {shape} on a {background} background {at_position}",
        "{background} background, {colour} {shape}, {position}",
        "{colour} {shape} on {background} {at_position}",
        "draw a {colour} {shape} {at_position} on {background}",
    ),
    "no position": (
        "a {colour} {shape} on a {background} background",
        "a {colour} {shape} on {background}",
        "{colour} {shape} on a {background} background",
        "{background} background, {colour} {shape}",
        "draw a {colour} {shape} on {background}",
    ),
    "no background": (
        "{colour} {shape}, {position}",
        "a {colour} {shape} {at_position}",
        "{position}: a {colour} {shape}",
        "a {colour} {shape}, {position}",
        "draw a {colour} {shape} {at_position}",
    ),
    "colour and shape": ("a {colour} {shape}", "{colour} {shape}", "the {colour} {shape}", "draw a {colour} {shape}"),
    "no colour": (
        "a {shape} on a {background} background",
        "a {shape} on {background}",
        "a {shape}, {position}",
        "a {shape} {at_position}",
        "a {shape} on a {background} background, {position}",
    ),
    "shape only": ("a {shape}", "{shape}", "the {shape}", "draw a {shape}", "draw the {shape}"),
}
CANONICAL_FAMILY = "template"
# How often training draws each family: captions naming every part most (they are what teaches composition: a left-out
# part is always drawn as the same default), a lone shape least.
FAMILY_WEIGHTS: dict[str, float] = {
    "template": 0.3, "reworded": 0.3, "no position": 0.1, "no background": 0.1,
    "colour and shape": 0.07, "no colour": 0.07, "shape only": 0.06,
}

# Shown beside the prompt box and drawn in the README grid: one per kind of phrasing.
EXAMPLE_PROMPTS: tuple[str, ...] = (
    "a red circle on a blue background, top left",
    "a yellow triangle on black, centre",
    "Green square in the bottom right corner.",
    "a white disc on a red background",
    "blue triangle, upper right",
    "a square",
)

_SLOT = re.compile(r"\{(\w+)\}")


@dataclass(frozen=True)
class Caption:
    """A caption's text and what it asks for, in canonical words; None where it leaves a part free."""

    text: str
    family: str
    template: str
    shape: str
    colour: str | None = None
    background: str | None = None
    position: str | None = None

    @property
    def parts(self) -> dict[str, str]:
        """The parts it asks for, by name."""
        named = {"shape": self.shape, "colour": self.colour, "background": self.background, "position": self.position}
        return {part: value for part, value in named.items() if value is not None}

    @property
    def canonical_text(self) -> str:
        """Its template filled with canonical words, unstyled: the same for every spelling of this caption."""
        return fill(self.template, self.parts)


def caption(family: str, parts: dict[str, str], rng: random.Random, template: str | None = None) -> Caption:
    """A caption of `family` for `parts` (canonical words): the template (random if None) with
    random synonyms and styling. The "template" family stays its one sentence exactly as written.
    """
    template = template or rng.choice(FAMILIES[family])
    text = fill(template, parts) if family == CANONICAL_FAMILY else style(fill(template, parts, rng), rng)
    return Caption(text, family, template, **{part: parts[part] for part in asked_parts(template)})


def asked_parts(template: str) -> frozenset[str]:
    """The scene parts a template names: shape, colour, background, position."""
    slots = set(_SLOT.findall(template))
    return frozenset({"position" if slot == "at_position" else slot for slot in slots})


def _spell(word: str, rng: random.Random | None) -> str:
    """A synonym of `word` (rng None: the canonical word)."""
    spellings = SYNONYMS.get(word, (word,))
    return spellings[0] if rng is None else rng.choice(spellings)


def _position_phrase(position: str, with_preposition: bool, rng: random.Random | None) -> str:
    words = [_spell(word, rng) for word in position.split()]
    joiner = " " if rng is None or rng.random() < 0.75 else "-"
    bare = joiner.join(words)
    if not with_preposition:
        return bare
    options = AT_POSITION + (AT_CORNER if len(words) == 2 else ())
    return (options[0] if rng is None else rng.choice(options)).format(bare)


def fill(template: str, parts: dict[str, str], rng: random.Random | None = None) -> str:
    """The template with its slots filled from `parts` (canonical words); rng picks synonyms and joiners."""
    def slot(match: re.Match) -> str:
        name = match[1]
        if name in ("position", "at_position"):
            return _position_phrase(parts["position"], name == "at_position", rng)
        return _spell(parts[name], rng)

    return _SLOT.sub(slot, template)


def style(text: str, rng: random.Random) -> str:
    """The text as people type it: mostly lower case, sometimes capitalised or shouted, with end punctuation."""
    case = rng.choices(("lower", "sentence", "upper", "title"), weights=(6, 3, 1, 1))[0]
    if case == "sentence":
        text = text[:1].upper() + text[1:]
    elif case == "upper":
        text = text.upper()
    elif case == "title":
        text = string.capwords(text)
    return text + rng.choices(("", ".", "!", "..."), weights=(6, 3, 1, 1))[0]


def words(text: str) -> list[str]:
    """The words of a text as the vocabulary counts them: runs of letters or digits, case-folded."""
    return re.findall(r"[^\W_]+", text.casefold())


def _vocabulary() -> tuple[str, ...]:
    """Every word a caption can contain: template words, the attribute words and their synonyms."""
    texts = [_SLOT.sub(" ", template) for templates in FAMILIES.values() for template in templates]
    texts += [*COLOURS, *SHAPES, *POSITIONS, *(s for spellings in SYNONYMS.values() for s in spellings)]
    texts += [phrase.format("") for phrase in AT_POSITION + AT_CORNER]
    return tuple(sorted({word for text in texts for word in words(text)}))


VOCABULARY: tuple[str, ...] = _vocabulary()


def _with_synonyms(word: str) -> str:
    others = SYNONYMS.get(word, (word,))[1:]
    return f"{word} ({', '.join(others)})" if others else word


def _position_words() -> str:
    """The positions, then the synonyms of the words that make up the two-word ones."""
    listed = ", ".join(_with_synonyms(position) for position in POSITIONS)
    corner_words = dict.fromkeys(word for position in POSITIONS if " " in position for word in position.split())
    swaps = [f"{other} for {word}" for word in corner_words for other in SYNONYMS.get(word, ())[1:]]
    return f"{listed}, with {' and '.join(swaps)}" if swaps else listed


# What a person reads after "it knows": colours; shapes; positions.
KNOWN_WORDS_SUMMARY: str = "; ".join(
    (", ".join(COLOURS), ", ".join(_with_synonyms(shape) for shape in SHAPES), _position_words())
)

