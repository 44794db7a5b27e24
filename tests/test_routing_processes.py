"""Routing with real processes on a private redis-server: the API and two tiny-model workers, NPC
conversations whose every turn repeats the conversation so far. Each turn after the first lands on
the worker that answered the one before (the note its answer left, shared/routing.py, names who
answered each turn); then one worker is SIGKILLed while turns are offered to it, and every request
is still answered, once, by the other.
"""
from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor

import pytest

from api.tokenizers import TokenizerCache
from shared import keys
from shared.routing import chain
from tests.processes import MODEL, live_worker_ids, make_client, models_served, start_api, stop, tiny_worker, wait_until

pytestmark = pytest.mark.timeout(300)

SYSTEM = "You are the innkeeper."  # short: the tiny models' context is 128 tokens
CONVERSATIONS, TURNS = 6, 2  # and one more after the kill: 3 turns, ~100 of the 128 tokens


def _turn(client, messages: list[dict], user: str) -> str:
    answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0, user=user)
    return answer.choices[0].message.content


def _who_answered(redis, tokenizer, messages: list[dict], user: str) -> str:
    """The worker whose answer noted this prompt's digest (its chat prompt, as the API renders it)."""
    note = redis.get(keys.route_prefix(MODEL) + chain(tokenizer.encode_chat(messages), user)[-1])
    return note.decode() if note else ""


def _conversation(client, redis, tokenizer, player: int, turns: int, messages=None) -> list[str]:
    """`turns` more turns of player `player`'s conversation: who answered each."""
    messages = messages if messages is not None else [{"role": "system", "content": SYSTEM}]
    user, answered_by = f"player-{player}", []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"p{player} q{turn}"})
        assert _turn(client, messages, user) is not None
        answered_by.append(_who_answered(redis, tokenizer, messages, user))
        # A short reply of our own in the history: a tiny model's random text re-tokenizes long,
        # and the next prompt starts with this one's all the same, which is what routes it.
        messages.append({"role": "assistant", "content": "Aye."})
    return answered_by


def test_each_turn_lands_on_the_worker_holding_its_conversation_and_a_killed_one_loses_nothing(
        redis_alone, tiny_model_dirs, tmp_path):
    # A long offer, so that a loaded machine's pauses never let another worker take a turn first.
    port, api = start_api(redis_alone, tmp_path, "api", "--affinity-wait", "2")
    workers = [tiny_worker(tiny_model_dirs["llama"], redis_alone, tmp_path, f"w{i}") for i in range(2)]
    procs = [api, *workers]
    redis = redis_alone.client()
    try:
        wait_until(lambda: MODEL in models_served(port) and len(live_worker_ids(redis)) == 2, procs, "two workers")
        client = make_client(port)
        tokenizer = TokenizerCache(redis).get(_info(redis))
        histories = [[{"role": "system", "content": SYSTEM}] for _ in range(CONVERSATIONS)]
        with ThreadPoolExecutor(CONVERSATIONS) as pool:
            runs = list(pool.map(lambda p: _conversation(client, redis, tokenizer, p, TURNS, histories[p]),
                                 range(CONVERSATIONS)))
        assert all(by and all(by) for by in runs), runs  # every turn answered, and noted
        for answered_by in runs:  # a conversation stays with the worker of its first turn
            assert set(answered_by) == {answered_by[0]}, runs
        # One worker dies while turns are offered to it: they wait out its heartbeat (or the offer),
        # then the other worker answers them; none is lost or answered twice.
        ids = live_worker_ids(redis)
        victim_id = runs[0][0]
        victim = workers[_index_of(redis, ids, victim_id, workers)]
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=10)
        with ThreadPoolExecutor(CONVERSATIONS) as pool:
            after = list(pool.map(lambda p: _conversation(client, redis, tokenizer, p, 1, histories[p]),
                                  range(CONVERSATIONS)))
        survivor = next(i for i in ids if i != victim_id)
        assert all(by == [survivor] for by in after), after
        assert all(len(h) == 1 + 2 * (TURNS + 1) for h in histories)  # every turn answered
    finally:
        for proc in procs:
            stop(proc)


def _info(redis):
    from api.broker import Broker
    return Broker(redis).workers_for(MODEL)[0]


def _index_of(redis, ids: list[str], worker_id: str, procs) -> int:
    """Which of the worker processes has `worker_id` (its registered pid)."""
    from api.broker import Broker
    pid = next(w.pid for w in Broker(redis).live_workers() if w.id == worker_id)
    return next(i for i, proc in enumerate(procs) if proc.pid == pid)
