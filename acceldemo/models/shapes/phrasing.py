"""The words tiny-shapes knows and the one sentence it was trained on; plain Python, so the catalog can read it.

Every training caption is `TEMPLATE` filled with a colour, a shape, another colour and a
position, in lower case: the tokenizer makes these words (after a space) single tokens and
spells everything else byte by byte, so any other word, or another way of saying the same
thing, is outside what the model has seen.
"""
from __future__ import annotations

import re

COLOURS: tuple[str, ...] = ("red", "green", "blue", "yellow", "white", "black")
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
POSITIONS: tuple[str, ...] = ("top left", "top right", "bottom left", "bottom right", "center")
TEMPLATE = "a {colour} {shape} on a {background} background, {position}"

# Shown beside the prompt box: captions in the pattern, each drawn right at 64x64 (tests/test_shapes_model.py).
EXAMPLE_PROMPTS: tuple[str, ...] = (
    "a red circle on a blue background, top left",
    "a yellow triangle on a black background, center",
    "a white square on a green background, top right",
    "a blue circle on a yellow background, top right",
    "a green square on a black background, bottom right",
    "a black triangle on a white background, bottom left",
)


def words(text: str) -> list[str]:
    """The words of a text as the vocabulary counts them: runs of letters or digits, case-folded."""
    return re.findall(r"[^\W_]+", text.casefold())


VOCABULARY: tuple[str, ...] = tuple(sorted(
    {word for text in (*COLOURS, *SHAPES, *POSITIONS, TEMPLATE.format(colour="", shape="", background="", position=""))
     for word in words(text)}))

_ONE_OF = {name: "(?:" + "|".join(map(re.escape, values)) + ")" for name, values in
           (("colour", COLOURS), ("shape", SHAPES), ("background", COLOURS), ("position", POSITIONS))}
# The template as a pattern (for re.fullmatch): exactly the training sentence, lower case.
PATTERN = re.escape(TEMPLATE).replace(r"\{", "{").replace(r"\}", "}").format(**_ONE_OF)

# What a person reads after "it knows".
KNOWN_WORDS_SUMMARY = "; ".join((", ".join(COLOURS), ", ".join(SHAPES), ", ".join(POSITIONS)))
PATTERN_SUMMARY = "one sentence, in lower case: 'a COLOUR SHAPE on a COLOUR background, POSITION'"
