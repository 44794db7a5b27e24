"""Redis Cluster, against real servers on loopback: three primaries (with a password) joined by
`redis-cli --cluster create`, a real API and three tiny-model workers serving three model names whose
hash tags put their keys on three different primaries. The API's REDIS_URL is a redis+cluster://
URL whose first host answers nothing; one worker is given a node's redis:// URL with REDIS_CLUSTER=1.

OpenAI's client asks each model for stories, streamed and not, at once: every request is answered in
full; each model's queues, processing lists, heartbeats, leases and result channels are in one slot,
held by the primary that holds its queue, and the three models' primaries differ; results travel by
sharded pub/sub (SSUBSCRIBE on each model's primary), none by plain pub/sub. A worker that died
holding a job (its processing list, its registration) has the job put back and answered by the live
worker of its model, and the answer published on that model's primary. A conversation's second turn
is routed to the worker that answered its first (the note and the notes' MGET on the model's slot).
A batch is refused with 501
(RQ does not work with a cluster); files still upload.

Then the cluster changes under a stream being written: a model's slot moves to another primary, and
a model's primary (given a replica) is SIGKILLed; each stream ends whole and later requests are
answered. A subscriber whose client knows an old layout follows the node's MOVED.
"""
from __future__ import annotations

import io
import json
import os
import shutil
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import redis

from api.broker import ShardedSubscriber
from shared import keys
from shared.protocol import Final, Job, SamplingParams, decode_result
from shared.redis_client import connect
from tests.processes import free_port, get_json, logs, make_client, start, stop, wait_for_servers, wait_until
from worker.faults import as_env

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

PASSWORD = "cluster pass"  # a space: percent-encoded in the URL
QUOTED = PASSWORD.replace(" ", "%20")
PRIMARIES = 3
NODE_TIMEOUT_MS = 2000
REQUESTS_PER_MODEL, AT_ONCE, TOKENS = 6, 6, 12
MOVING_TOKENS = 60  # at the slow worker's 0.05 s a step: a few seconds of stream to move a slot under
API_KEY = "cluster-test-key"


class Node:
    """One cluster-enabled redis-server of the test's own, in its own directory."""

    def __init__(self, directory: Path):
        directory.mkdir(parents=True, exist_ok=True)
        self.port, self.directory, self.log = _cluster_port(), directory, directory / "redis-server.log"
        binary = shutil.which("redis-server") or pytest.fail("redis-server is not installed (test.sh installs it)")
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(directory),
                 "--save", "", "--appendonly", "no", "--cluster-enabled", "yes",
                 "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
                 "--requirepass", PASSWORD, "--masterauth", PASSWORD],
                stdout=log, stderr=subprocess.STDOUT, cwd=directory)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, password=PASSWORD, socket_timeout=5)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


def _cluster_port() -> int:
    """A free port whose cluster bus port (10,000 higher, which a node listens on too) is free and valid."""
    for _ in range(1000):
        port = free_port()
        if port + 10000 <= 65535:
            with socket.socket() as bus:
                try:
                    bus.bind(("127.0.0.1", port + 10000))
                    return port
                except OSError:
                    pass
    raise AssertionError("no port pair found")


def _wait(ready, what: str, nodes: list[Node], timeout: float = 30) -> None:
    wait_for_servers(ready, what, [n.log for n in nodes], timeout)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("cluster")
    nodes = [Node(root / f"node-{i}") for i in range(PRIMARIES)]
    try:
        _wait(lambda: all(n.client().ping() for n in nodes), "the nodes to start", nodes)
        cli = shutil.which("redis-cli") or pytest.fail("redis-cli is not installed (test.sh installs it)")
        # The password in the environment (REDISCLI_AUTH), not on a command line `ps` shows.
        made = subprocess.run([cli, "--cluster", "create", *(n.address for n in nodes), "--cluster-replicas", "0",
                               "--cluster-yes"], env={**os.environ, "REDISCLI_AUTH": PASSWORD},
                              capture_output=True, text=True, timeout=60)
        assert made.returncode == 0, made.stdout + made.stderr
        _wait(lambda: all(n.client().execute_command("CLUSTER INFO")["cluster_state"] == "ok" for n in nodes),
              "every node to see the cluster whole", nodes)
        yield nodes
    finally:
        for node in nodes:
            node.stop()


def _primary_of(nodes: list[Node], key: str) -> Node:
    slot = nodes[0].client().execute_command("CLUSTER KEYSLOT", key)
    for start_slot, end_slot, (host, port, *_), *_ in nodes[0].client().execute_command("CLUSTER SLOTS"):
        if start_slot <= slot <= end_slot:
            return next(n for n in nodes if n.port == int(port))
    raise AssertionError(f"no node holds slot {slot}")


def _names_on_distinct_primaries(nodes: list[Node], count: int) -> list[str]:
    """`count` model names whose keys the cluster puts on `count` different primaries."""
    names, taken = [], set()
    for i in range(200):
        name = f"tale-{i}"
        node = _primary_of(nodes, keys.queue(name))
        if node.port not in taken:
            names.append(name)
            taken.add(node.port)
            if len(names) == count:
                return names
    raise AssertionError("no names found on distinct primaries")


def _ask(client: openai.OpenAI, model: str, i: int) -> dict:
    request = dict(model=model, max_tokens=TOKENS, extra_body={"ignore_eos": True})
    if i % 3 == 0:  # streamed
        text, finish = "", None
        for chunk in client.completions.create(prompt=f"Tale {i}:", stream=True, **request):
            text += chunk.choices[0].text if chunk.choices else ""
            finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
        return dict(model=model, i=i, finish=finish, tokens=None, text=text)
    if i % 3 == 1:  # chat, streamed
        text, finish = "", None
        for chunk in client.chat.completions.create(messages=[{"role": "user", "content": f"Tale {i}"}],
                                                    stream=True, **request):
            text += (chunk.choices[0].delta.content or "") if chunk.choices else ""
            finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
        return dict(model=model, i=i, finish=finish, tokens=None, text=text)
    answer = client.completions.create(prompt=f"Tale {i}:", **request)
    return dict(model=model, i=i, finish=answer.choices[0].finish_reason, tokens=answer.usage.completion_tokens,
                text=answer.choices[0].text)


def test_models_spread_over_a_clusters_primaries_and_every_request_is_answered(cluster, tiny_model_dirs,
                                                                                tmp_path):
    nodes = cluster
    models = _names_on_distinct_primaries(nodes, PRIMARIES)
    homes = {model: _primary_of(nodes, keys.queue(model)) for model in models}
    hosts = ",".join(n.address for n in nodes)
    # The first host answers nothing: the client starts from the next one.
    url = f"redis+cluster://:{QUOTED}@127.0.0.1:{free_port()},{hosts}"
    port, procs = free_port(), []
    try:
        for model, kind in zip(models, ("llama", "gpt2", "llama")):
            env = dict(REDIS_URL=url)
            if model == models[-1]:  # a node's plain URL, said to be a cluster's
                env = dict(REDIS_URL=f"redis://:{QUOTED}@{nodes[-1].address}/0", REDIS_CLUSTER="1")
            procs.append(start(["worker", "--model", tiny_model_dirs[kind], "--model-name", model, "--dtype",
                                "float32", "--batch", "8", "--wait", "5"], tmp_path, f"worker-{model}", **env))
        api = start(["api", "--port", str(port), "--max-queue", "0", "--request-timeout", "60"], tmp_path, "api",
                    REDIS_URL=url, API_KEYS=API_KEY, RATE_LIMIT="10000")
        procs.append(api)
        client = make_client(port, API_KEY)
        wait_until(lambda: _served(client) == set(models), procs, "/v1/models to list every model", timeout=120)
        assert "cluster pass" not in logs(*procs) and QUOTED not in logs(*procs)

        with ThreadPoolExecutor(AT_ONCE) as pool:
            answers = list(pool.map(lambda mi: _ask(client, *mi),
                                    [(m, i) for i in range(REQUESTS_PER_MODEL) for m in models]))
        assert len(answers) == REQUESTS_PER_MODEL * len(models)
        for answer in answers:
            assert answer["finish"] == "length" and answer["text"], answer
            assert answer["tokens"] in (None, TOKENS), answer

        # Each model's keys share one slot, on the primary of its queue; the three primaries differ.
        any_node = nodes[0].client()
        for model in models:
            (worker_id,) = [w.decode() for w, m in _all_workers(nodes).items() if m.decode() == model]
            named = [keys.queue(model, p) for p in (-10, 0, 10)] + [
                keys.wake(model), keys.processing(model, worker_id), keys.heartbeat(model, worker_id),
                keys.model_workers(model), keys.tokenizer(model), keys.lease(model, "j"), keys.answer(model, "j"),
                keys.cancel(model, "j"), keys.attempts(model, "j"), keys.channel(model, "j"),
                keys.written(model, "j"), keys.written_by(model, "j"), keys.live_numerics(model, "x"),
                keys.drained_prefix(model) + "1", keys.worker_wake(model, worker_id), keys.route_prefix(model) + "d"]
            assert len({any_node.execute_command("CLUSTER KEYSLOT", k) for k in named}) == 1, model
            # Asked directly (no cluster client), the home node has them; another would answer MOVED.
            home = homes[model]
            assert home.client().exists(keys.heartbeat(model, worker_id), keys.tokenizer(model)) == 2
            assert home.client().hexists(keys.model_workers(model), worker_id)
            for other in (n for n in nodes if n is not home):
                with pytest.raises(redis.exceptions.MovedError, match=f"{home.address}$"):
                    other.client().exists(keys.tokenizer(model))
        assert len({homes[m].port for m in models}) == PRIMARIES

        # Results went by sharded pub/sub: the API's subscriber listens on every model's primary
        # (SSUBSCRIBE), and no node has a plain subscription.
        for model in models:
            assert homes[model].client().execute_command("PUBSUB SHARDCHANNELS"), model
        assert all(n.client().execute_command("PUBSUB CHANNELS") == [] for n in nodes)
        assert all(n.client().execute_command("PUBSUB NUMPAT") == 0 for n in nodes)

        # A conversation's next turn is routed on a cluster too: the answer's note and the next
        # turn's MGET of its prompt's notes run on the model's slot.
        story = "Once upon a time a fox and a crow met by the river, and the crow had a piece of cheese. " * 2
        for turn in (story, story + "The fox spoke first."):
            client.completions.create(model=models[0], prompt=turn, max_tokens=2, user="player-1")

        # /health and /metrics read across the slots.
        assert get_json(f"http://127.0.0.1:{port}/health")[0] == 200
        metrics = _get_text(f"http://127.0.0.1:{port}/metrics")
        for model in models:
            assert f'storyteller_workers_alive{{model="{model}"}} 1.0' in metrics
        assert f'storyteller_routed_requests_total{{model="{models[0]}"}} 1.0' in metrics, metrics

        _dead_workers_job_is_put_back(nodes, url, models[1], homes[models[1]], procs)

        # The batch API: files upload (their record and content share a slot), batches are refused.
        line = {"custom_id": "a", "method": "POST", "url": "/v1/completions",
                "body": {"model": models[0], "prompt": "x", "max_tokens": 2}}
        uploaded = client.files.create(file=("in.jsonl", io.BytesIO(json.dumps(line).encode())), purpose="batch")
        assert client.files.content(uploaded.id).text.strip() == json.dumps(line)
        with pytest.raises(openai.APIStatusError) as refused:
            client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
        assert refused.value.status_code == 501 and "Cluster" in refused.value.message
        assert all(p.poll() is None for p in procs), logs(*procs)
    finally:
        for proc in procs:
            stop(proc)


def test_a_models_slot_moved_to_another_primary_mid_stream(cluster, tiny_model_dirs, tmp_path):
    """The slot of a model's keys moves to another primary while a stream is being written (as
    `redis-cli --cluster reshard` moves slots): the worker's scripts and blocking pop follow the keys
    (redis-py's MOVED and ASK handling), the old primary unsubscribes the API's sharded channels of
    that slot, and the API subscribes them again on the new one. The stream ends whole, with the text
    the same request writes after the move, and later requests are answered too."""
    nodes, model = cluster, "moving-tale"
    source = _primary_of(nodes, keys.queue(model))
    target = next(n for n in nodes if n is not source)
    url = f"redis+cluster://:{QUOTED}@{source.address}"
    port, procs = free_port(), []
    try:
        client, request = _slow_stack(url, model, port, tiny_model_dirs, tmp_path, procs)

        text, finish, usage = _stream_disturbed(
            client, request, lambda: _move_slot(nodes, _slot(nodes, keys.queue(model)), source, target), "move")
        assert finish == "length" and usage.completion_tokens == MOVING_TOKENS, logs(*procs)
        assert _primary_of(nodes, keys.queue(model)) is target
        assert target.client().exists(keys.tokenizer(model)), "the model's keys moved with their slot"
        # The same request written again, now on the new primary, writes the same text.
        assert client.completions.create(**request).choices[0].text == text, logs(*procs)
        streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **request)
                           if c.choices)
        assert streamed == text
        # The API listens on the new primary now.
        assert target.client().execute_command("PUBSUB SHARDCHANNELS"), logs(*procs)
        assert all(p.poll() is None for p in procs), logs(*procs)
    finally:
        for proc in procs:
            stop(proc)


def test_a_subscriber_that_knows_an_old_layout_follows_the_slot(cluster):
    """An API process whose client still places a slot on its old primary subscribes there: the node
    refuses (MOVED), and the subscriber moves the request's channels to the primary the refusal names;
    the request is confirmed as usual, and hears what is published there."""
    nodes, model = cluster, "wandering-tale"
    url = f"redis+cluster://:{QUOTED}@{nodes[0].address}"
    stale = connect(url, socket_timeout=5)  # its layout read now, before the move
    subscriber = ShardedSubscriber(stale)
    source = _primary_of(nodes, keys.queue(model))
    target = next(n for n in nodes if n is not source)
    try:
        # The subscriber's connection to the old primary is up (another model's request there).
        neighbour = _name_on(nodes, source, avoid=model)
        subscriber.listen([keys.channel(neighbour, "n-0").encode()])
        _move_slot(nodes, _slot(nodes, keys.queue(model)), source, target)
        channel = keys.channel(model, "w-0").encode()
        inbox = subscriber.listen([channel])  # returns once a node confirmed it: the new primary
        assert target.client().execute_command("SPUBLISH", channel, b"heard") == 1
        assert inbox.messages.get(timeout=5) == (channel, b"heard")
        subscriber.forget(inbox)
        assert subscriber.channels == 1  # the neighbour's
    finally:
        stale.close()


def _name_on(nodes: list[Node], node: Node, avoid: str) -> str:
    """A model name whose keys `node` holds, other than `avoid` and not in its slot."""
    avoided = _slot(nodes, keys.queue(avoid))
    return next(name for name in (f"near-{i}" for i in range(1000)) if _primary_of(nodes, keys.queue(name)) is node
                and _slot(nodes, keys.queue(name)) != avoided)


def test_a_primary_killed_mid_stream_its_replica_takes_over(cluster, tiny_model_dirs, tmp_path):
    """A model's primary, with a replica, is SIGKILLed while a stream is being written: the cluster
    promotes the replica; the worker's commands fail until redis-py finds the new primary, and then
    go on; the API's subscriber of the dead node moves the request's channels to the promoted one.
    The stream ends whole, with the text the same request writes afterwards, and later requests are
    answered. (Last in this file: the cluster keeps the replica as a primary, the killed node gone.)"""
    nodes, model = cluster, "failing-tale"
    primary = _primary_of(nodes, keys.queue(model))
    replica = Node(tmp_path / "replica")
    procs = []
    try:
        _wait(lambda: replica.client().ping(), "the replica to start", [replica])
        made = subprocess.run([shutil.which("redis-cli"), "--cluster", "add-node", replica.address, primary.address,
                               "--cluster-slave", "--cluster-master-id", _node_id(primary)],
                              env={**os.environ, "REDISCLI_AUTH": PASSWORD}, capture_output=True, text=True,
                              timeout=60)
        assert made.returncode == 0, made.stdout + made.stderr
        _wait(lambda: replica.client().info("replication").get("master_link_status") == "up",
              "the replica to sync", [primary, replica])
        url = f"redis+cluster://:{QUOTED}@{','.join(n.address for n in [*nodes, replica])}"
        port = free_port()
        client, request = _slow_stack(url, model, port, tiny_model_dirs, tmp_path, procs)

        def kill_primary():
            # Replication is asynchronous: the job taken and leased must be on the replica, or the
            # fail-over loses it (which is no part of what is tested here).
            assert primary.client().execute_command("WAIT", 1, 5000) == 1
            primary.process.kill()

        text, finish, usage = _stream_disturbed(client, request, kill_primary, "kill")
        assert finish == "length" and usage.completion_tokens == MOVING_TOKENS, logs(*procs)
        assert replica.client().execute_command("ROLE")[0] == b"master"
        assert client.completions.create(**request).choices[0].text == text, logs(*procs)
        streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **request)
                           if c.choices)
        assert streamed == text
        assert all(p.poll() is None for p in procs), logs(*procs)
    finally:
        for proc in procs:
            stop(proc)
        replica.stop()


def _slow_stack(url: str, model: str, port: int, tiny_model_dirs, tmp_path, procs: list) -> tuple:
    """A slow worker (the tests' step_delay_s fault, worker/faults.py: a stream is still being written when the test
    disturbs the cluster) and an API on `url`, appended to `procs`; (client, a request it answered)."""
    procs.append(start(["worker", "--model", tiny_model_dirs["llama"], "--model-name", model, "--dtype",
                        "float32", "--batch", "4", "--wait", "5"], tmp_path, "worker", REDIS_URL=url,
                       **as_env(step_delay_s=0.05)))
    procs.append(start(["api", "--port", str(port), "--max-queue", "0", "--request-timeout", "60"], tmp_path,
                       "api", REDIS_URL=url))
    client = make_client(port)
    wait_until(lambda: _served(client) == {model}, procs, f"/v1/models to list {model}", timeout=120)
    request = dict(model=model, prompt="The gate", max_tokens=MOVING_TOKENS, temperature=0,
                   extra_body={"ignore_eos": True})
    assert client.completions.create(**request).choices[0].finish_reason == "length"  # all is up
    return client, request


def _stream_disturbed(client: openai.OpenAI, request: dict, disturb, what: str) -> tuple:
    """Streams `request`, calling `disturb` once its first text has come; (text, finish, usage)."""
    text, finish, usage, disturbed_at = "", None, None, None
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **request):
        if chunk.choices:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        usage = chunk.usage or usage
        if disturbed_at is None and text:  # under way
            disturb()
            disturbed_at = len(text)
    assert disturbed_at is not None and disturbed_at < len(text), f"the {what} came after the stream had ended"
    return text, finish, usage


def _node_id(node: Node) -> str:
    node_id = node.client().execute_command("CLUSTER MYID")
    return node_id.decode() if isinstance(node_id, bytes) else node_id


def _slot(nodes: list[Node], key: str) -> int:
    return nodes[0].client().execute_command("CLUSTER KEYSLOT", key)


def _move_slot(nodes: list[Node], slot: int, source: Node, target: Node) -> None:
    """What `redis-cli --cluster reshard` does for one slot: mark it moving, MIGRATE its keys, then
    tell every node (the target first) that the target holds it."""
    source_id, target_id = (n.client().execute_command("CLUSTER MYID") for n in (source, target))
    target.client().execute_command("CLUSTER SETSLOT", slot, "IMPORTING", source_id)
    source.client().execute_command("CLUSTER SETSLOT", slot, "MIGRATING", target_id)
    while names := source.client().execute_command("CLUSTER GETKEYSINSLOT", slot, 100):
        source.client().execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "AUTH", PASSWORD,
                                        "KEYS", *names)
    for node in [target, source, *(n for n in nodes if n not in (source, target))]:
        node.client().execute_command("CLUSTER SETSLOT", slot, "NODE", target_id)


def _dead_workers_job_is_put_back(nodes, url, model, home, procs) -> None:
    """A worker of `model` that died holding a job: its live colleague's heartbeat puts the job back
    (one script on the model's primary) and answers it on the model's sharded channel."""
    cluster_client = connect(url, socket_timeout=5)
    job = Job(id="dead-job-1", model=model, prompt_ids=[5, 6, 7], timeout_s=60,
              params=SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    listening = home.client().pubsub()
    listening.ssubscribe(keys.channel(model, job.id))
    assert listening.get_message(timeout=5)["type"] == "ssubscribe"
    try:
        pipe = cluster_client.pipeline(transaction=True)  # one slot: a MULTI in a cluster
        pipe.rpush(keys.processing(model, "dead-1"), job.to_json())
        pipe.hset(keys.model_workers(model), "dead-1", 1)
        pipe.execute()
        cluster_client.hset(keys.WORKERS, "dead-1", model)
        final, give_up = None, time.monotonic() + 20
        while final is None and time.monotonic() < give_up:
            message = listening.get_message(ignore_subscribe_messages=True, timeout=0.5)
            if message:
                result = decode_result(message["data"])
                final = result if isinstance(result, Final) else None
        assert isinstance(final, Final) and final.completion_tokens == 4, logs(*procs)
        assert isinstance(decode_result(cluster_client.get(keys.answer(model, job.id))), Final)
        assert cluster_client.llen(keys.processing(model, "dead-1")) == 0
        assert not cluster_client.hexists(keys.WORKERS, "dead-1")
        assert not cluster_client.hexists(keys.model_workers(model), "dead-1")
    finally:
        listening.close()
        cluster_client.close()


def _all_workers(nodes: list[Node]) -> dict:
    return connect(f"redis+cluster://:{QUOTED}@{nodes[0].address}").hgetall(keys.WORKERS)


def _served(client: openai.OpenAI) -> set[str]:
    try:
        return {m.id for m in client.models.list().data}
    except openai.APIError:  # not listening yet
        return set()


def _get_text(url: str) -> str:
    import urllib.request
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read().decode()
