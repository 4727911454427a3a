"""Every pair of a request's choices works or is refused up front (`tests/pairwise.py`): the refusals, and the cases
this engine draws — this process's devices, and the torchrun pool for tp, cfg and cp. The cases whose executor is the
fleet are planned here (so every pair with `executor=fleet` is in the plan) but not drawn yet: they need the Ray
cluster of `tests/fleet_cluster.py`."""
from __future__ import annotations

import numpy as np
import pytest

from acceldemo.errors import AcceldemoError
from tests.engines import new_manager
from tests.pairwise import SEED, Case, Plan, every_pair, pairs, plan

# The plan alone asks the engine's check a few hundred times.
pytestmark = pytest.mark.slow

@pytest.fixture(scope="module")
def engine():
    m = new_manager()
    yield m
    m.close()


def _accepts(engine, case: Case) -> bool:
    try:
        engine.check(case.params())
        return True
    except AcceldemoError:
        return False


@pytest.fixture(scope="module")
def cases(engine) -> Plan:
    return plan(lambda case: _accepts(engine, case))


def _pixels(image) -> np.ndarray:
    return np.asarray(image, dtype=np.int16)


def draw_against_reference(engine, case: Case, references: dict) -> str | None:
    """What is wrong with the case's images against its reference's (None: nothing)."""
    events = []
    result = engine.submit(engine.check(case.params()), events.append).result()
    if len(result.images) != case.batch:
        return f"{len(result.images)} images for a batch of {case.batch}"
    for i, image in enumerate(result.images):
        key = (case.reference(), SEED + i)
        if key not in references:
            references[key] = _pixels(engine.generate(key[0].params(SEED + i)).image)
        drawn, expected = _pixels(image), references[key]
        if drawn.shape != expected.shape or drawn.std() <= 1:
            return f"image {i}: {drawn.shape}, std {drawn.std():.1f}"
        worst = int(np.abs(drawn - expected).max())
        if worst > 2:
            return f"image {i} differs from {case.reference()}'s by {worst}/255"
    if any(event.preview is not None for event in events) != case.previews:
        return f"previews asked: {case.previews}, sent: {not case.previews}"
    return None


def test_the_cases_hold_every_pair_and_the_refusals_only_pairs_no_drawn_case_holds(cases):
    drawn = set().union(*(pairs(case) for case in cases.drawn))
    refused = {pair for case in cases.refused for pair in pairs(case) - drawn}
    assert drawn | refused >= every_pair()
    assert 20 <= len(cases.drawn) <= 60 and len(cases.refused) < 80, (len(cases.drawn), len(cases.refused))


def test_each_refused_pair_is_refused_by_the_check_naming_its_choice(engine, cases):
    loaded = len(engine.snapshot().pipelines)
    wrong = []
    for case in cases.refused:
        try:
            engine.check(case.params())
            wrong.append(f"{case}: accepted")
        except AcceldemoError as refused:
            if not case.named(refused.field):
                wrong.append(f"{case}: refused for {refused.field!r}, none of its choices: {refused}")
    assert not wrong, "\n".join(wrong)
    assert len(engine.snapshot().pipelines) == loaded  # refused before any load or compile


@pytest.mark.timeout(1200)
def test_each_drawn_case_draws_its_reference_s_picture(engine, cases):
    references: dict = {}
    wrong = [f"{case}: {problem}" for case in cases.drawn if case.executor == "engine"
             for problem in [draw_against_reference(engine, case, references)] if problem]
    assert not wrong, "\n".join(wrong)
