"""The embedded shapes model draws what people ask, as they write it, at every size it offers, from the committed weights."""
from __future__ import annotations

import itertools
import json
import random

import numpy as np
import pytest
import torch
from diffusers import Flux2KleinPipeline
from PIL import Image

from acceldemo.models.catalog import CATALOG, get_model
from acceldemo.models.shapes import (
    RECOMMENDED_MAX_SEQUENCE_LENGTH,
    RECOMMENDED_STEPS,
    SIZES,
    TRAINED_SIZES,
    trained_model_dir,
)
from acceldemo.models.shapes.phrasing import (
    CANONICAL_WORD,
    EXAMPLE_PROMPTS,
    FAMILIES,
    VOCABULARY,
    Caption,
    caption,
    words,
)
from acceldemo.records import Shape
from training.shapes.dataset import (
    COLOURS,
    PALETTE,
    POSITION_CENTRES,
    POSITIONS,
    SHAPES,
    Scene,
    all_scenes,
    held_out_captions,
    held_out_scenes,
    is_held_out,
    is_trained_on,
    render,
    scene_drawn_for,
    training_caption,
    training_scenes,
)
from training.shapes.judge import judge

pytestmark = pytest.mark.heavy  # outside the quick tier (scripts/test.sh --fast); run in CI

SHAPES_MODEL = get_model("tiny-shapes")
# Held-out scenes: no training caption names all four of their parts.
HELD_OUT = [
    Scene("circle", "red", "black", "center"),
    Scene("square", "blue", "white", "bottom left"),
    Scene("triangle", "green", "black", "top right"),
]


def _load() -> Flux2KleinPipeline:
    pipe = Flux2KleinPipeline.from_pretrained(trained_model_dir())
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _draw(pipe: Flux2KleinPipeline, prompts: list[str], size: tuple[int, int] = SIZES[0], seed: int = 0,
          max_sequence_length: int = RECOMMENDED_MAX_SEQUENCE_LENGTH) -> list[Image.Image]:
    width, height = size
    return pipe(
        prompt=prompts,
        height=height,
        width=width,
        num_inference_steps=RECOMMENDED_STEPS,
        guidance_scale=1.0,
        max_sequence_length=max_sequence_length,
        generator=[torch.Generator("cpu").manual_seed(seed + i) for i in range(len(prompts))],
    ).images


def _assert_drawn_as_asked(images: list[Image.Image], asked: list[Scene | Caption]) -> None:
    for image, wanted in zip(images, asked, strict=True):
        verdict = judge(image).matches(wanted)
        assert all(verdict.values()), f"{wanted} at {image.size} was drawn as {judge(image)}"


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


# --- data, phrasing and judge ---------------------------------------------------------------------

def test_held_out_scenes_only_recombine_attribute_pairs_seen_in_training():
    def pairs(scene: Scene) -> set:
        return set(itertools.combinations(scene.parts.items(), 2))

    seen = set().union(*(pairs(scene) for scene in training_scenes()))
    assert len(all_scenes()) == len(SHAPES) * len(COLOURS) * (len(COLOURS) - 1) * len(POSITIONS)
    assert all(scene.is_held_out for scene in HELD_OUT)
    assert held_out_scenes() and all(pairs(scene) <= seen for scene in held_out_scenes())


@pytest.mark.parametrize("size", TRAINED_SIZES, ids=lambda size: f"{size[0]}x{size[1]}")
def test_a_shape_is_22_pixels_across_at_every_size_and_placed_by_fractions_of_the_frame(size):
    width, height = size
    for position, (x, y) in POSITION_CENTRES.items():
        pixels = np.asarray(render(Scene("square", "red", "blue", position), width, height))
        rows, columns = np.nonzero(np.abs(pixels.astype(int) - PALETTE["red"]).sum(axis=2) < 60)
        assert columns.max() - columns.min() + 1 == 22 and rows.max() - rows.min() + 1 == 22, (size, position)
        assert abs((columns.min() + columns.max() + 1) / 2 - x * width) <= 0.5, (size, position)
        assert abs((rows.min() + rows.max() + 1) / 2 - y * height) <= 0.5, (size, position)


def test_every_family_has_held_out_captions_that_training_never_draws():
    rng = random.Random(0)
    trained = [training_caption(rng.choice(training_scenes()), rng) for _ in range(3000)]
    assert {caption.family for caption in trained} == set(FAMILIES)
    assert not any(is_held_out(caption) for caption in trained)
    trained_texts = {caption.canonical_text for caption in trained}
    for family in FAMILIES:
        held_out = held_out_captions(family, 20)
        assert len(held_out) == 20 and all(caption.family == family and is_held_out(caption) for caption in held_out)
        assert not trained_texts & {caption.canonical_text for caption in held_out}


def test_a_caption_asks_for_exactly_the_parts_its_words_name():
    rng = random.Random(1)
    scene = Scene("square", "red", "blue", "top left")
    for family in FAMILIES:
        for _ in range(20):
            drawn = caption(family, scene.parts, rng)
            text = words(drawn.text)
            assert drawn.shape == "square" and "square" in text, drawn
            assert ("red" in text) == (drawn.colour == "red"), drawn
            assert ("blue" in text) == (drawn.background == "blue"), drawn
            assert ("left" in text) == (drawn.position == "top left"), drawn


def test_left_out_parts_are_completed_by_the_defaults_whatever_the_split_and_training_never_draws_a_held_out_scene():
    for family in FAMILIES:
        for held_out in held_out_captions(family, 10):
            scene = scene_drawn_for(held_out)
            assert held_out.parts.items() <= scene.parts.items(), held_out
    assert scene_drawn_for(Caption("a square", "shape only", "a {shape}", "square")) == Scene(
        "square", "white", "black", "center")
    assert scene_drawn_for(Caption("a black disc", "colour and shape", "a {colour} {shape}", "circle", "black")) == \
        Scene("circle", "black", "white", "center")
    # The centre scene is held out; its caption without a position still means the centre, not another
    # position that training may draw (that exception is what drew held-out "..., center" scenes elsewhere).
    no_position = Caption("a black circle on a red background", "no position",
                          "a {colour} {shape} on a {background} background", "circle", "black", "red")
    assert scene_drawn_for(no_position) == Scene("circle", "black", "red", "center") in held_out_scenes()
    assert not is_held_out(no_position) and not is_trained_on(no_position)

    rng, scenes = random.Random(2), training_scenes()
    trained = [training_caption(rng.choice(scenes), rng) for _ in range(3000)]
    trained_on = set(scenes)
    assert all(is_trained_on(caption) and scene_drawn_for(caption) in trained_on for caption in trained)
    assert {caption.family for caption in trained} == set(FAMILIES)


def test_every_spelling_of_a_known_word_is_one_token_sharing_its_canonical_embedding(eager_pipe):
    tokenizer, embeddings = eager_pipe.tokenizer, eager_pipe.text_encoder.get_input_embeddings().weight
    for word in VOCABULARY:
        canonical = embeddings[tokenizer(" " + CANONICAL_WORD.get(word, word))["input_ids"][0]]
        for spelling in ("", " ", "-", ","):
            for case in (word, word.capitalize(), word.upper()):
                ids = tokenizer(f"1{spelling}{case}")["input_ids"]
                assert len(ids) == 2, (spelling, case)
                assert len(word) == 1 and not spelling or torch.equal(embeddings[ids[1]], canonical), (spelling, case)


@pytest.mark.parametrize("size", TRAINED_SIZES, ids=lambda size: f"{size[0]}x{size[1]}")
def test_judge_reads_every_drawn_scene_at_every_size(size):
    for index, scene in enumerate(all_scenes()):
        assert all(judge(render(scene, *size, seed=index)).matches(scene).values()), (scene, size)


def test_judge_accepts_any_value_for_a_part_the_caption_leaves_out_but_wants_a_shape():
    drawn = judge(render(Scene("square", "red", "blue", "top left"), 128, 64, seed=0))
    assert all(drawn.matches(Caption("a red square", "colour and shape", "a {colour} {shape}", "square", "red")).values())
    assert all(drawn.matches(Caption("a square", "shape only", "a {shape}", "square")).values())
    assert not drawn.matches(Caption("a circle", "shape only", "a {shape}", "circle"))["shape"]
    blank = judge(Image.new("RGB", (64, 64), PALETTE["blue"])).matches(Caption("a square", "shape only", "a {shape}",
                                                                                "square"))
    assert not blank["shape"] and not blank["colour"] and blank["background"]


def test_the_scene_check_names_a_held_out_scene_drawn_wrong_for_half_its_seeds():
    from training.shapes.evaluate import scene_report

    moved = Scene(HELD_OUT[0].shape, HELD_OUT[0].colour, HELD_OUT[0].background, "top left")
    drawn = [(scene, scene) for scene in HELD_OUT for _ in range(4)]
    drawn[:2] = [(HELD_OUT[0], moved)] * 2  # two of its four seeds drawn top left
    report = scene_report([render(shown, 64, 64, seed=i) for i, (_, shown) in enumerate(drawn)],
                          [asked for asked, _ in drawn])
    assert report["scenes"] == 3 and report["holding"] == pytest.approx(2 / 3)
    assert report["weak"] == [{"caption": HELD_OUT[0].template_caption, "right": 2, "of": 4, "wrong": {"position": 2}}]


def test_the_evaluation_scores_every_size_and_family_and_checks_each_held_out_scene(tmp_path):
    from training.shapes.evaluate import main

    out = tmp_path / "evaluation.json"
    main(["--captions-per-family", "1", "--seeds-per-scene", "1", "--json", str(out)])
    report = json.loads(out.read_text())
    sizes = [f"{width}x{height}" for width, height in TRAINED_SIZES]
    assert list(report["generated"]) == list(report["held_out_scenes"]) == sizes
    assert all(list(report["generated"][size]) == list(FAMILIES) for size in sizes)
    assert all(scores == {"colours": 1.0, "position": 1.0, "shape": 1.0} for scores in report["ground_truth"].values())
    for size in sizes:
        check = report["held_out_scenes"][size]
        assert check["scenes"] == len(held_out_scenes())
        assert check["holding"] == pytest.approx(1 - len(check["weak"]) / check["scenes"])
    served = report["held_out_scenes"][f"{SIZES[0][0]}x{SIZES[0][1]}"]
    assert served["holding"] >= 0.75, served["weak"]
    assert report["served_sizes"] == [f"{width}x{height}" for width, height in SIZES]


# --- what the catalog tells the page and the API --------------------------------------------------

def test_tiny_shapes_offers_only_the_sizes_it_draws_right_at():
    assert SHAPES_MODEL.presets == tuple(Shape(*size) for size in SIZES)
    assert SHAPES_MODEL.default_shape == Shape(64, 64) and SHAPES_MODEL.only_presets
    assert not any(spec.only_presets for name, spec in CATALOG.items() if name != "tiny-shapes")


def test_unknown_words_are_named_once_in_prompt_order():
    prompt = "A yellow square on a PURPLE background, centre — purple, sparkly!"
    assert SHAPES_MODEL.unknown_words(prompt) == ("purple", "sparkly")
    note = SHAPES_MODEL.prompt_note(prompt)
    assert note.startswith("tiny-shapes does not know: purple, sparkly — it knows red, green, blue, yellow, white, black;")
    assert all(word in note for word in (*SHAPES, *POSITIONS, "disc", "middle", "upper"))


def test_a_long_prompt_of_unknown_words_gets_a_short_note():
    prompt = " ".join(f"word{i}" for i in range(200))
    assert len(SHAPES_MODEL.unknown_words(prompt)) == 200
    note = SHAPES_MODEL.prompt_note(prompt)
    assert note.startswith("tiny-shapes does not know: word0, word1,") and "word11 and 188 more — it knows red" in note


def test_known_words_in_any_case_and_punctuation_get_no_note():
    for prompt in ("a red square on a blue background", "Top-left: a GREEN disc on black!", *EXAMPLE_PROMPTS):
        assert SHAPES_MODEL.unknown_words(prompt) == () and SHAPES_MODEL.prompt_note(prompt) == "", prompt


def test_models_without_a_vocabulary_never_complain():
    spec = get_model("tiny-flux2-klein")
    assert spec.unknown_words("a purple unicorn") == () and spec.prompt_note("a purple unicorn") == ""


# --- the committed pipeline ----------------------------------------------------------------------

def test_attention_heads_divide_by_four_for_tensor_parallelism(eager_pipe):
    assert eager_pipe.transformer.config.num_attention_heads % 4 == 0
    assert eager_pipe.text_encoder.config.num_attention_heads % 4 == 0
    assert eager_pipe.text_encoder.config.num_key_value_heads % 4 == 0


def test_a_caption_without_position_gives_the_asked_colours(eager_pipe):
    # Its shape is the weak part: squares come out as rounded blobs (judged square in 6 of 16 seeds here;
    # MODEL_CARD.md, Limitations), so only the colours are asked of every seed.
    asked = Caption("a red square on a blue background", "no position", "", "square", "red", "blue")
    for image in _draw(eager_pipe, [asked.text] * 4):
        drawn = judge(image)
        assert (drawn.colour, drawn.background) == ("red", "blue"), drawn


def test_a_colour_and_a_shape_alone_give_that_shape_in_that_colour(eager_pipe):
    asked = Caption("a green circle", "colour and shape", "", "circle", "green")
    _assert_drawn_as_asked(_draw(eager_pipe, [asked.text] * 2), [asked] * 2)


def test_held_out_captions_are_drawn_as_asked(eager_pipe):
    _assert_drawn_as_asked(_draw(eager_pipe, [scene.template_caption for scene in HELD_OUT]), HELD_OUT)


def test_the_catalog_serves_it_with_the_text_length_it_was_trained_for():
    assert SHAPES_MODEL.max_sequence_length == RECOMMENDED_MAX_SEQUENCE_LENGTH


def test_same_seed_gives_the_identical_image(eager_pipe):
    first, second = (np.asarray(_draw(eager_pipe, [HELD_OUT[0].template_caption], seed=7)[0]) for _ in range(2))
    assert np.array_equal(first, second)


@pytest.mark.parametrize("mode", ["compiled", "regional"])
def test_compiled_transformer_draws_like_eager(eager_pipe, mode):
    pipe = _load()
    options = {"backend": "aot_eager", "fullgraph": True, "dynamic": False}
    if mode == "compiled":
        pipe.transformer.compile(**options)
    else:
        pipe.transformer.compile_repeated_blocks(**options)
    prompts = [scene.template_caption for scene in HELD_OUT]
    try:
        # Other tests compiled this transformer code at other shapes already: room for this one, as the app gives.
        with torch._dynamo.config.patch(recompile_limit=64):
            compiled = _draw(pipe, prompts)
    finally:
        torch._dynamo.reset()
    _assert_drawn_as_asked(compiled, HELD_OUT)
    eager = _draw(eager_pipe, prompts)
    for left, right in zip(compiled, eager, strict=True):
        assert np.abs(np.asarray(left, dtype=int) - np.asarray(right, dtype=int)).max() <= 1


# What each example prompt asks for; a part it leaves out may be drawn as anything.
EXAMPLE_ASKS = {
    "a red circle on a blue background, top left": dict(shape="circle", colour="red", background="blue",
                                                        position="top left"),
    "a yellow triangle on black, centre": dict(shape="triangle", colour="yellow", background="black", position="center"),
    "Green square in the bottom right corner.": dict(shape="square", colour="green", position="bottom right"),
    "a white disc on a red background": dict(shape="circle", colour="white", background="red"),
    "blue triangle, upper right": dict(shape="triangle", colour="blue", position="top right"),
    "a square": dict(shape="square"),
}


@pytest.mark.parametrize("size", SIZES, ids=lambda size: f"{size[0]}x{size[1]}")
def test_every_example_prompt_is_drawn_as_it_says_at_every_size(eager_pipe, size):
    assert tuple(EXAMPLE_ASKS) == SHAPES_MODEL.example_prompts == EXAMPLE_PROMPTS
    asked = [Caption(prompt, "example", "", **parts) for prompt, parts in EXAMPLE_ASKS.items()]
    _assert_drawn_as_asked(_draw(eager_pipe, list(EXAMPLE_ASKS), size), asked)


def test_the_text_encoder_gives_every_phrasing_of_a_caption_the_same_conditioning(eager_pipe):
    same = ["a green circle on a black background, top left", "Top-left: a GREEN disc on black!",
            "green circle on black in the upper-left corner"]
    other = ["a green circle on a black background, top right", "a green square on a black background, top left"]
    embeds = eager_pipe.encode_prompt(prompt=same + other, device="cpu",
                                      max_sequence_length=RECOMMENDED_MAX_SEQUENCE_LENGTH)[0][:, -1]  # a pad token
    spread = max(torch.dist(embeds[0], embeds[i]).item() for i in range(1, len(same)))
    apart = min(torch.dist(embeds[0], embeds[i]).item() for i in range(len(same), len(embeds)))
    assert spread < 0.1 * apart, (spread, apart)


def test_the_training_recipe_runs_end_to_end_and_saves_a_loadable_pipeline(tmp_path):
    from training.shapes.train import TrainingPlan, train

    plan = TrainingPlan(vae_steps=2, latent_pool_per_scene=1, text_steps=2, transformer_steps=2, long_text_every=2)
    summary = train(tmp_path, plan)
    assert summary["sizes"] == ["64x64", "128x128", "128x64", "64x128"] and summary["plan"]["text_steps"] == 2
    assert 0 <= summary["text_code_accuracy_last_100_steps"] <= 1 and summary["transformer_loss_last_200_steps"] > 0
    pipe = Flux2KleinPipeline.from_pretrained(tmp_path)
    pipe.set_progress_bar_config(disable=True)
    assert _draw(pipe, ["a red square"])[0].size == (64, 64)


@pytest.mark.slow
def test_retraining_only_the_transformer_keeps_the_text_encoder_and_vae_and_checkpoints_as_it_goes(tmp_path):
    from safetensors.torch import load_file

    from training.shapes.train import TrainingPlan, train

    source = trained_model_dir()
    plan = TrainingPlan(latent_pool_per_scene=1, transformer_steps=3, long_text_every=2, rope_axes="2,10,10,2",
                        size_schedule="1,0", checkpoint_every=1, text_and_vae_from=str(source))
    summary = train(tmp_path, plan)
    for part in ("text_encoder", "vae"):
        kept, committed = (load_file(next((folder / part).glob("*.safetensors"))) for folder in (tmp_path, source))
        # The VAE's batch-norm statistics are set again from this run's latent pools (one drawing per scene here).
        weights = [key for key in committed if not key.startswith("bn.")]
        assert kept.keys() == committed.keys() and all(torch.equal(kept[k], committed[k]) for k in weights), part
    assert summary["text_and_vae"]["from"] == str(source)
    assert summary["text_and_vae"]["text_code_accuracy_last_100_steps"] == 1.0
    assert not (tmp_path / "checkpoint.json").exists()  # the last checkpoint became the final model
    pipe = Flux2KleinPipeline.from_pretrained(tmp_path)
    assert tuple(pipe.transformer.config.axes_dims_rope) == (2, 10, 10, 2)
    pipe.set_progress_bar_config(disable=True)
    assert _draw(pipe, ["a red square"])[0].size == (64, 64)


def test_a_checkpoint_is_a_loadable_pipeline_that_says_its_step(tmp_path):
    from training.shapes.train import _save_checkpoint

    pipe = Flux2KleinPipeline.from_pretrained(trained_model_dir())
    pipe.save_pretrained(tmp_path)
    ema = {name: torch.zeros_like(value) for name, value in pipe.transformer.state_dict().items()}
    _save_checkpoint(pipe, ema, tmp_path, 500)
    assert json.loads((tmp_path / "checkpoint.json").read_text()) == {"transformer_step": 500}
    reloaded = Flux2KleinPipeline.from_pretrained(tmp_path)
    assert all(not value.any() for value in reloaded.transformer.state_dict().values())
    assert any(value.any() for value in pipe.transformer.state_dict().values())  # the live model is untouched


def test_a_size_schedule_outside_the_trained_sizes_is_refused_before_training(tmp_path):
    from training.shapes.train import TrainingPlan, train

    with pytest.raises(ValueError, match=r"size_schedule='0,4'.*indices into 4 sizes"):
        train(tmp_path, TrainingPlan(size_schedule="0,4"))
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("blocks", ["3", "3,0", "a,b", "2,4,1"])
def test_a_bad_transformer_block_count_is_refused_before_training(tmp_path, blocks):
    from training.shapes.train import TrainingPlan, train

    with pytest.raises(ValueError, match=rf"transformer_blocks='{blocks}': two positive counts"):
        train(tmp_path, TrainingPlan(transformer_blocks=blocks))
    assert not any(tmp_path.iterdir())


def test_training_on_from_a_transformer_with_other_rope_axes_is_refused(tmp_path):
    from training.shapes.train import TrainingPlan, train

    plan = TrainingPlan(rope_axes="2,10,10,2", transformer_from=str(trained_model_dir()),
                        text_and_vae_from=str(trained_model_dir()))
    with pytest.raises(ValueError, match=r"has rope axes \(6, 6, 6, 6\), not rope_axes='2,10,10,2'"):
        train(tmp_path, plan)
    assert not any(tmp_path.iterdir())


def test_a_transformer_grown_by_new_blocks_computes_what_the_smaller_one_did(eager_pipe):
    from training.shapes.architecture import build_transformer
    from training.shapes.train import grow_transformer

    smaller = eager_pipe.transformer
    kinds = ("transformer_blocks", "single_transformer_blocks")
    have = tuple(len(getattr(smaller, kind)) for kind in kinds)
    grown = build_transformer(tuple(smaller.config.axes_dims_rope), (have[0] + 1, have[1] + 2))
    grow_transformer(grown, smaller)
    generator = torch.Generator().manual_seed(0)
    image_ids = torch.cartesian_prod(*map(torch.arange, (1, 8, 16, 1))).unsqueeze(0)
    text_ids = torch.cartesian_prod(*map(torch.arange, (1, 1, 1, 24))).unsqueeze(0)
    inputs = dict(hidden_states=torch.randn(1, 128, smaller.config.in_channels, generator=generator),
                  encoder_hidden_states=torch.randn(1, 24, smaller.config.joint_attention_dim, generator=generator),
                  timestep=torch.tensor([0.6]), img_ids=image_ids, txt_ids=text_ids, return_dict=False)
    with torch.no_grad():
        wanted, got = smaller(**inputs)[0], grown(**inputs)[0]
    assert wanted.abs().mean() > 0.1
    torch.testing.assert_close(got, wanted, atol=1e-4, rtol=1e-4)
    new_block = grown.single_transformer_blocks[have[1] + 1]
    assert not new_block.attn.to_out.weight.any() and new_block.attn.to_qkv_mlp_proj.weight.any()
    with pytest.raises(ValueError, match=rf"has {have[0]} transformer_blocks; the plan asks for {have[0] - 1}"):
        grow_transformer(build_transformer(blocks=(have[0] - 1, have[1])), smaller)


@pytest.mark.slow
def test_training_on_from_a_saved_transformer_starts_from_its_weights(tmp_path):
    from training.shapes.train import TrainingPlan, train

    source = trained_model_dir()
    plan = TrainingPlan(latent_pool_per_scene=1, transformer_steps=2, long_text_every=2, warmup_steps=1,
                        transformer_learning_rate=1e-12, text_and_vae_from=str(source), transformer_from=str(source))
    summary = train(tmp_path, plan)
    assert summary["transformer"]["from"] == str(source)
    assert summary["transformer"]["steps"] == 12000 + 7000 + 6000 + 3000  # the committed model is four runs
    before = Flux2KleinPipeline.from_pretrained(source).transformer.state_dict()
    after = Flux2KleinPipeline.from_pretrained(tmp_path).transformer.state_dict()
    assert max((after[name] - before[name]).abs().max().item() for name in before) < 1e-6


@pytest.mark.slow
def test_training_on_into_more_blocks_saves_a_grown_transformer_that_draws_what_the_smaller_did(tmp_path, eager_pipe):
    from training.shapes.train import TrainingPlan, train

    source = trained_model_dir()
    double, single = len(eager_pipe.transformer.transformer_blocks), len(eager_pipe.transformer.single_transformer_blocks)
    plan = TrainingPlan(latent_pool_per_scene=1, transformer_steps=2, long_text_every=2, warmup_steps=1,
                        transformer_learning_rate=1e-12, transformer_blocks=f"{double + 1},{single + 1}",
                        text_and_vae_from=str(source), transformer_from=str(source))
    summary = train(tmp_path, plan)
    assert summary["plan"]["transformer_blocks"] == f"{double + 1},{single + 1}"
    grown = Flux2KleinPipeline.from_pretrained(tmp_path)
    grown.set_progress_bar_config(disable=True)
    assert (grown.transformer.config.num_layers, grown.transformer.config.num_single_layers) == (double + 1, single + 1)
    prompts = ["a red circle on a blue background, top left", "a green square"]
    for before, after in zip(_draw(eager_pipe, prompts), _draw(grown, prompts), strict=True):
        difference = np.abs(np.asarray(before, dtype=int) - np.asarray(after, dtype=int))
        assert difference.max() <= 2, difference.max()
