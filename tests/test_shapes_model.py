"""The embedded shapes model draws what it is asked, eager and compiled, from the committed weights."""
from __future__ import annotations

import itertools
import re

import numpy as np
import pytest
import torch
from diffusers import Flux2KleinPipeline

from acceldemo.models.catalog import CATALOG, get_model
from acceldemo.models.shapes import RECOMMENDED_STEPS, trained_model_dir
from acceldemo.models.shapes.dataset import (
    COLOURS,
    POSITIONS,
    SHAPES,
    Scene,
    all_scenes,
    held_out_scenes,
    render,
    training_scenes,
)
from acceldemo.models.shapes.judge import judge
from acceldemo.models.shapes.phrasing import words
from acceldemo.records import Shape

# Held-out captions: the model never saw these during training.
PROMPTED_SCENES = [
    Scene("circle", "red", "black", "center"),
    Scene("square", "blue", "white", "bottom left"),
    Scene("triangle", "green", "black", "top right"),
]


def _load() -> Flux2KleinPipeline:
    pipe = Flux2KleinPipeline.from_pretrained(trained_model_dir())
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _draw(pipe: Flux2KleinPipeline, scenes: list[Scene], seed: int = 0, max_sequence_length: int = 512) -> list:
    return pipe(
        prompt=[scene.caption for scene in scenes],
        height=64,
        width=64,
        num_inference_steps=RECOMMENDED_STEPS,
        guidance_scale=1.0,
        max_sequence_length=max_sequence_length,
        generator=[torch.Generator("cpu").manual_seed(seed + i) for i in range(len(scenes))],
    ).images


def _assert_colours_and_positions_right(images: list, scenes: list[Scene]) -> None:
    for image, scene in zip(images, scenes, strict=True):
        verdict = judge(image).matches(scene)
        assert verdict["colours"] and verdict["position"], f"{scene.caption!r} was drawn as {judge(image)}"


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """On a busy 2-core host, 2 threads run this tiny model 20-50× slower than 1."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def eager_pipe() -> Flux2KleinPipeline:
    return _load()


def test_prompted_scenes_are_held_out():
    assert all(scene.is_held_out for scene in PROMPTED_SCENES)


def test_held_out_split_only_recombines_attribute_pairs_seen_in_training():
    def pairs(scene: Scene) -> set:
        attributes = [("shape", scene.shape), ("colour", scene.colour), ("background", scene.background),
                      ("position", scene.position)]
        return set(itertools.combinations(attributes, 2))

    seen = set().union(*(pairs(scene) for scene in training_scenes()))
    assert len(all_scenes()) == len(SHAPES) * len(COLOURS) * (len(COLOURS) - 1) * len(POSITIONS)
    assert held_out_scenes() and all(pairs(scene) <= seen for scene in held_out_scenes())


def test_judge_reads_every_drawn_scene():
    for index, scene in enumerate(all_scenes()):
        assert judge(render(scene, seed=index)).matches(scene) == dict.fromkeys(
            ("colour", "background", "colours", "position", "shape"), True
        ), scene.caption


def test_attention_heads_divide_by_four_for_tensor_parallelism(eager_pipe):
    assert eager_pipe.transformer.config.num_attention_heads % 4 == 0
    assert eager_pipe.text_encoder.config.num_attention_heads % 4 == 0
    assert eager_pipe.text_encoder.config.num_key_value_heads % 4 == 0


@pytest.mark.parametrize("max_sequence_length", [512, 64])
def test_eager_pipeline_draws_the_asked_colours_and_positions(eager_pipe, max_sequence_length):
    images = _draw(eager_pipe, PROMPTED_SCENES, max_sequence_length=max_sequence_length)
    _assert_colours_and_positions_right(images, PROMPTED_SCENES)


def test_same_seed_gives_the_identical_image(eager_pipe):
    first, second = (np.asarray(_draw(eager_pipe, PROMPTED_SCENES[:1], seed=7)[0]) for _ in range(2))
    assert np.array_equal(first, second)


@pytest.mark.parametrize("mode", ["compiled", "regional"])
def test_compiled_transformer_draws_like_eager(eager_pipe, mode):
    pipe = _load()
    options = {"backend": "aot_eager", "fullgraph": True, "dynamic": False}
    if mode == "compiled":
        pipe.transformer.compile(**options)
    else:
        pipe.transformer.compile_repeated_blocks(**options)
    try:
        compiled = _draw(pipe, PROMPTED_SCENES)
    finally:
        torch._dynamo.reset()
    _assert_colours_and_positions_right(compiled, PROMPTED_SCENES)
    eager = _draw(eager_pipe, PROMPTED_SCENES)
    for left, right in zip(compiled, eager, strict=True):
        assert np.abs(np.asarray(left, dtype=int) - np.asarray(right, dtype=int)).max() <= 1


# --- what the catalog tells the page and the API --------------------------------------------------

SHAPES_MODEL = get_model("tiny-shapes")


def test_tiny_shapes_is_served_only_at_the_size_it_was_trained_at():
    assert SHAPES_MODEL.presets == (Shape(64, 64),) and SHAPES_MODEL.default_shape == Shape(64, 64)
    assert SHAPES_MODEL.only_presets
    assert not any(spec.only_presets for name, spec in CATALOG.items() if name != "tiny-shapes")


def test_its_vocabulary_is_every_word_of_its_training_captions():
    captions = [scene.caption for scene in all_scenes()]
    assert set(SHAPES_MODEL.vocabulary) == {word for caption in captions for word in words(caption)}
    assert all(re.fullmatch(SHAPES_MODEL.prompt_pattern, caption) for caption in captions)
    assert all(SHAPES_MODEL.prompt_note(caption) == "" for caption in captions)


def test_unknown_words_are_named_once_in_prompt_order():
    prompt = "a yellow square on a PURPLE background, center — purple, sparkly!"
    assert SHAPES_MODEL.unknown_words(prompt) == ("purple", "sparkly")
    note = SHAPES_MODEL.prompt_note("a yellow square on a purple background, center")
    assert note == ("tiny-shapes does not know: purple — it knows red, green, blue, yellow, white, black; circle, "
                    "square, triangle; top left, top right, bottom left, bottom right, center")


def test_a_phrasing_it_was_not_trained_on_is_said_even_in_known_words():
    for prompt in ("a red square on a blue background", "A red square on a blue background, top left", "red square"):
        assert SHAPES_MODEL.unknown_words(prompt) == ()
        assert SHAPES_MODEL.prompt_note(prompt) == (
            "tiny-shapes was trained on one sentence, in lower case: 'a COLOUR SHAPE on a COLOUR background, "
            "POSITION'; other phrasings are drawn unreliably"), prompt
    assert SHAPES_MODEL.prompt_note("a purple square") == (  # an unknown word alone says enough
        "tiny-shapes does not know: purple — it knows red, green, blue, yellow, white, black; circle, square, "
        "triangle; top left, top right, bottom left, bottom right, center")


def test_a_long_prompt_of_unknown_words_gets_a_short_note():
    prompt = " ".join(f"word{i}" for i in range(200))
    assert len(SHAPES_MODEL.unknown_words(prompt)) == 200
    assert "word11 and 188 more — it knows red" in SHAPES_MODEL.prompt_note(prompt)


def test_models_without_a_vocabulary_never_complain():
    spec = get_model("tiny-flux2-klein")
    assert spec.unknown_words("a purple unicorn") == () and spec.prompt_note("a purple unicorn") == ""


def test_every_example_prompt_is_drawn_as_it_says(eager_pipe):
    by_caption = {scene.caption: scene for scene in all_scenes()}
    scenes = [by_caption[prompt] for prompt in SHAPES_MODEL.example_prompts]
    for seed in (0, 1):
        images = _draw(eager_pipe, scenes, seed=seed)
        for image, scene in zip(images, scenes, strict=True):
            assert all(judge(image).matches(scene).values()), (scene, seed, judge(image))
