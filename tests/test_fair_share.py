"""A fair share per client: the line takes turns across clients and caps how many of one client's requests wait
(ACCELDEMO_CLIENT_QUEUE) — in the line itself, then through /v1 with two keys and the page's Gradio API with two
sessions on the real server."""
import asyncio
import hashlib
import time

import httpx
import pytest
from gradio_client import Client

from acceldemo.config import Settings
from acceldemo.engine.admission import Line
from acceldemo.errors import ClientQueueFull, QueueFull
from acceldemo.records import DeviceSet
from acceldemo.ui.keys import Keys, client_name
from acceldemo.ui.server import create_app
from tests.engines import DeviceHolder, new_manager, serving, settings_with

CPU = DeviceSet("cpu", (0,))


def test_a_client_with_one_request_goes_before_the_second_of_a_client_with_many():
    line = Line(limit=8, wait_s=60, client_limit=4)
    running = line.enter("a1", [CPU], client="a")
    assert running.granted == CPU
    a2, a3 = (line.enter(f"a{i}", [CPU], client="a") for i in (2, 3))
    b1 = line.enter("b1", [CPU], client="b")
    assert [line.place(t) for t in (b1, a2, a3)] == [1, 2, 3]  # b's first turn before a's second and third
    line.release(running)
    assert b1.granted == CPU and a2.granted is None
    line.release(b1)
    assert a2.granted == CPU  # then a again, in arrival order
    engine_own = line.enter("warm-up", [CPU], admitted=True)  # the engine's own tickets each take a first turn
    assert line.place(engine_own) == 1 and line.place(a3) == 2


def test_past_its_share_a_client_is_refused_by_name_and_others_are_admitted():
    line = Line(limit=8, wait_s=60, client_limit=2)
    line.enter("a1", [CPU], client="a")
    for i in (2, 3):
        line.enter(f"a{i}", [CPU], client="a")
    with pytest.raises(ClientQueueFull) as refused:
        line.enter("a4", [CPU], client="a")
    assert str(refused.value).startswith("you already have 2 request(s) waiting for a device, as many as one client "
                                         "may (ACCELDEMO_CLIENT_QUEUE=2)")
    assert isinstance(refused.value, QueueFull) and len(line.waiting()) == 2  # a 429 like the line's, nothing held
    with pytest.raises(ClientQueueFull):  # a request of 2 images that would both wait: all or none
        line.enter_together("a5", [CPU], 2, client="a")
    assert line.enter("b1", [CPU], client="b").granted is None and len(line.waiting()) == 3
    full = Line(limit=2, wait_s=60, client_limit=2)  # a share as big as the line: the line's own limit speaks
    for i in range(3):
        full.enter(f"a{i}", [CPU], client="a")
    with pytest.raises(QueueFull) as refused:
        full.enter("a3", [CPU], client="a")
    assert type(refused.value) is QueueFull and "ACCELDEMO_QUEUE_SIZE=2" in str(refused.value)


@pytest.mark.parametrize(("environ", "share"), [
    ({}, 16), ({"ACCELDEMO_QUEUE_SIZE": "8"}, 2), ({"ACCELDEMO_QUEUE_SIZE": "2"}, 2),
    ({"ACCELDEMO_QUEUE_SIZE": "1"}, 1), ({"ACCELDEMO_QUEUE_SIZE": "8", "ACCELDEMO_CLIENT_QUEUE": "3"}, 3),
    ({"ACCELDEMO_QUEUE_SIZE": "8", "ACCELDEMO_CLIENT_QUEUE": "50"}, 8),
])
def test_the_share_defaults_to_a_quarter_of_the_line_and_at_least_two(environ, share):
    assert Settings.from_env(environ).client_queue_limit == share


@pytest.mark.parametrize("value", ["0", "-1", "abc", "1.5", "100001"])
def test_a_client_queue_that_is_not_a_count_is_refused(value):
    with pytest.raises(ValueError, match=f"ACCELDEMO_CLIENT_QUEUE='{value}' is not accepted"):
        Settings.from_env({"ACCELDEMO_CLIENT_QUEUE": value})


def test_whom_the_line_counts():
    keys = Keys({"alice": hashlib.sha256(b"k").digest()})
    alice = keys.client_door("Bearer k")
    assert client_name(alice) == "alice" and client_name(alice, "u-1") == "alice/u-1"
    visitor = keys.caller(None)
    assert client_name(visitor, "u-1", peer="10.0.0.2") == "peer:10.0.0.2"  # a user without a key names nobody
    assert client_name(visitor, session="s1", peer="10.0.0.2") == "session:s1"


ALICE, BOB = "alice-key-4f1d9a0c2e", "bob-key-77aa01c3d9"


@pytest.fixture(scope="module")
def fair(tmp_path_factory):
    """A real server whose line holds 8, 2 of them per client, with keys for alice and bob."""
    key_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    key_file.write_text("".join(f"{name} {hashlib.sha256(key.encode()).hexdigest()}\n"
                                for name, key in (("alice", ALICE), ("bob", BOB))))
    engine = new_manager(settings_with(queue_size=8, client_queue=2, default_model="tiny-shapes"))
    with serving(create_app(engine, keys=Keys.from_settings(str(key_file)))) as url:
        yield url, engine
    engine.close()


async def v1(client: httpx.AsyncClient, key: str, seed: int, **fields) -> tuple[int, str, float]:
    started = time.monotonic()
    answer = await client.post("/v1/images/generations", headers={"Authorization": f"Bearer {key}"},
                               json={"prompt": "a red circle", "size": "64x64", "num_inference_steps": 2,
                                     "seed": seed, **fields})
    message = answer.json()["error"]["message"] if answer.status_code != 200 else ""
    return answer.status_code, message, time.monotonic() - started


@pytest.mark.slow
def test_over_v1_one_keys_burst_leaves_the_other_key_its_turn(fair):
    url, engine = fair
    holder = DeviceHolder(engine)
    holder.start()  # the device busy: every request of the burst would wait

    async def burst():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            alice = [asyncio.create_task(v1(client, ALICE, i)) for i in range(12)]
            deadline = time.monotonic() + 60
            # The device is held: whatever is answered before it is released was refused at once.
            while engine.queue_depth() < 2 or sum(task.done() for task in alice) < 10:
                assert time.monotonic() < deadline, (engine.queue_depth(), [task.done() for task in alice])
                await asyncio.sleep(0.05)
            refused = [task for task in alice if task.done()]
            await asyncio.sleep(0.5)
            bob = asyncio.create_task(v1(client, BOB, 100))
            while engine.queue_depth() < 3:
                await asyncio.sleep(0.05)
            holder.release()
            return await asyncio.gather(*alice), await bob, len(refused)

    alice, bob, refused_at_once = asyncio.run(burst())
    codes = [code for code, _, _ in alice]
    assert codes.count(200) == 2 and codes.count(429) == 10 and refused_at_once >= 10, codes
    assert all("ACCELDEMO_CLIENT_QUEUE=2" in message for code, message, _ in alice if code == 429)
    assert bob[0] == 200
    served_last = sorted(seconds for code, _, seconds in alice if code == 200)[-1]
    assert bob[2] < served_last  # bob's one request went before alice's second waiting one


@pytest.mark.slow
def test_through_the_gradio_api_two_sessions_take_turns(fair):
    url, engine = fair
    args = ["a red circle", "tiny-shapes", "cpu", "eager", "auto", None, "64x64", 2, 1.0]
    holder = DeviceHolder(engine)
    holder.start()
    first = Client(url + "/", verbose=False, headers={"Authorization": f"Bearer {ALICE}"})
    jobs = [first.submit(*args, i, api_name="/generate") for i in range(6)]
    deadline = time.monotonic() + 60
    while engine.queue_depth() < 2 or sum(job.done() for job in jobs) < 4:
        assert time.monotonic() < deadline, (engine.queue_depth(), [job.done() for job in jobs])
        time.sleep(0.1)
    second = Client(url + "/", verbose=False)  # a visitor: a session of its own
    other = second.submit(*args, 99, api_name="/generate")
    while engine.queue_depth() < 3:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    holder.release()
    outcomes = []
    for job in jobs:
        try:
            job.result(timeout=120)
            outcomes.append("served")
        except Exception as error:  # gradio_client's AppError carries the engine's message
            outcomes.append(str(error))
    assert outcomes.count("served") == 2, outcomes
    assert all("ACCELDEMO_CLIENT_QUEUE=2" in o for o in outcomes if o != "served")
    assert other.result(timeout=120)[2]["seed"] == 99


@pytest.mark.slow
@pytest.mark.parametrize(("trusted", "admitted"), [("10.9.9.9", 2), ("127.0.0.1", 3)])
def test_a_forwarded_address_names_the_client_only_from_a_trusted_proxy(fresh_manager, trusted, admitted):
    """Without keys a /v1 client is its peer address, as uvicorn gives it: X-Forwarded-For counts only from a peer
    in --forwarded-allow-ips (FORWARDED_ALLOW_IPS), so from anyone else a new header per request is still one client."""
    engine = fresh_manager(queue_size=8, client_queue=2, default_model="tiny-shapes")
    holder = DeviceHolder(engine)
    holder.start()
    try:
        with serving(create_app(engine), forwarded_allow_ips=trusted) as url:
            async def three():
                async with httpx.AsyncClient(base_url=url, timeout=120) as client:
                    async def one(i):
                        answer = await client.post("/v1/images/generations", headers={"X-Forwarded-For": f"1.2.3.{i}"},
                                                   json={"prompt": "x", "size": "64x64", "num_inference_steps": 1})
                        return answer.status_code, answer.text
                    sent = [asyncio.create_task(one(i)) for i in range(3)]
                    while engine.queue_depth() + sum(t.done() for t in sent) < 3:
                        await asyncio.sleep(0.05)
                    waiting = engine.queue_depth()
                    holder.release()
                    return waiting, await asyncio.gather(*sent)
            waiting, answers = asyncio.run(three())
    finally:
        holder.release()
    assert waiting == admitted, answers
    refused = [text for code, text in answers if code == 429]
    assert len(refused) == 3 - admitted and all("ACCELDEMO_CLIENT_QUEUE=2" in text for text in refused)


def test_an_openai_user_past_256_characters_is_refused_by_name(fresh_manager):
    from fastapi.testclient import TestClient

    with TestClient(create_app(fresh_manager())) as client:
        answer = client.post("/v1/images/generations", json={"prompt": "x", "user": "u" * 257})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "user", answer.text
        answer = client.post("/v1/images/generations", json={"prompt": "x", "safety_identifier": "s" * 300})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "safety_identifier"
