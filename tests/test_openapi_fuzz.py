"""The API against its own description (GET /openapi.json), fuzzed by schemathesis.

A real redis-server, `python -m api` and a tiny-model worker; schemathesis sends thousands of
generated requests, valid and invalid, and checks every answer: never a 5xx, never a status, content
type, header or body the description does not have (each server-sent event too), invalid data always
refused, and no request left hanging (a per-request timeout counts as a failure; a stream must reach
its [DONE]). Three schemathesis processes run side by side: the completion routes, the same always
streaming, and every other route. Also, fast: the description names exactly the routes Flask has.
"""
from __future__ import annotations

import base64
import collections
import copy
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import fakeredis
import pytest
import schemathesis

from api.app import create_app
from api.openapi import document
from shared.settings import Settings
from tests.processes import get_json, logs, make_client, models_served, start_api, stop, tiny_worker, wait_until

MODEL = "tiny-llama"  # the worker names the model after its directory's basename
CHECKS = ["not_a_server_error", "status_code_conformance", "content_type_conformance",
          "response_headers_conformance", "response_schema_conformance",
          # invalid data must be refused: the API is no looser than its description
          "negative_data_rejection", "unsupported_method", "allow_header_conformance"]
FUZZ_SECONDS = 50       # the two passes on the completion routes, side by side (the rest: half)
GENERATE = "^/v1/(chat/)?completions$"
BATCH_FILE = json.dumps({"custom_id": "lore-1", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": MODEL, "messages": [{"role": "user", "content": "A gate?"}]}}) + "\n"
REQUEST_TIMEOUT_S = 20  # a request slower than this is a hang: 64 choices of the tiny model take ~1 s
LEAST_REQUESTS = 1000   # all passes together: ~4,300 on a 2-core machine (busy with other work too)


def _flask_routes(app) -> dict[str, set[str]]:
    routes: dict[str, set[str]] = {}
    for rule in app.url_map.iter_rules():
        if rule.endpoint == "static":
            continue
        path = rule.rule.replace("<", "{").replace(">", "}")  # /v1/files/<file_id>: no converters used
        routes.setdefault(path, set()).update(rule.methods - {"HEAD", "OPTIONS"})
    return routes


def test_the_description_has_every_route_and_only_those():
    app = create_app(Settings(), client=fakeredis.FakeRedis())
    described = {path: {method.upper() for method in operations}
                 for path, operations in document()["paths"].items()}
    assert _flask_routes(app) == described


def test_the_description_is_served_and_loads_cleanly():
    client = create_app(Settings(), client=fakeredis.FakeRedis()).test_client()
    response = client.get("/openapi.json")
    assert response.status_code == 200 and response.get_json() == json.loads(json.dumps(document()))
    loaded = schemathesis.openapi.from_dict(response.get_json())
    labels = {operation.ok().label for operation in loaded.get_all_operations()}  # .ok() raises on a bad one
    assert labels == {f"{method.upper()} {path}" for path, operations in document()["paths"].items()
                      for method in operations}


def _integer_fields(schema: dict, names: tuple[str, ...]):
    """The integer branch of each named (nullable) field of a request schema."""
    for name in names:
        for branch in schema["properties"][name]["anyOf"]:
            if branch.get("type") == "integer":
                yield branch


@dataclass
class Known:
    """What only the running service knows, for schemathesis to aim at."""
    context_window: int
    file_ids: list[str]   # uploaded before the fuzzing, which may delete them
    batch_input: str      # another, which no URL names: batches are made from it all along
    batch_ids: list[str]  # made from it (no RQ worker runs them: they stay validating till cancelled)


def _seed_batches(port: int, count: int = 3) -> tuple[list[str], str, list[str]]:
    with make_client(port) as client:
        files = [client.files.create(file=("lore.jsonl", BATCH_FILE.encode()), purpose="batch").id
                 for _ in range(count + 1)]
        batches = [client.batches.create(input_file_id=files[-1], endpoint="/v1/chat/completions",
                                         completion_window="24h").id for _ in range(count)]
    return files[:-1], files[-1], batches


def _narrowed(description: dict, known: Known) -> dict:
    """The description, told what only the running service knows: the model it serves, that model's
    context window, files and batches that exist, and what a valid batch file holds.

    Otherwise a random model name only ever reaches the 404, a random max_tokens mostly the 400 for
    exceeding the window, a random id the 404 and random bytes the 400 for a bad batch file; told,
    schemathesis gets most valid requests through (and invalid ones are still made up around them).
    """
    narrowed = copy.deepcopy(description)
    schemas, paths = narrowed["components"]["schemas"], narrowed["paths"]
    # Chat's max_tokens is left alone: beside max_completion_tokens it is unused, so any size goes.
    for name, max_fields in [("CompletionRequest", ("max_tokens",)),
                             ("ChatCompletionRequest", ("max_completion_tokens",))]:
        schemas[name]["properties"]["model"] = {"type": "string", "enum": [MODEL]}
        for branch in _integer_fields(schemas[name], max_fields):
            branch["maximum"] = known.context_window
    schemas["FileUpload"]["properties"]["file"]["enum"] = [BATCH_FILE]
    schemas["BatchRequest"]["properties"]["input_file_id"]["enum"] = [known.batch_input]
    for path, operations in paths.items():
        for operation in operations.values():
            for parameter in operation.get("parameters", []):
                ids = known.file_ids if parameter["name"] == "file_id" else known.batch_ids
                parameter["schema"] = {"type": "string", "enum": ids}
    return narrowed


def _streaming(description: dict) -> dict:
    """Only `stream: true`: left to chance, few generated requests would stream."""
    streaming = copy.deepcopy(description)
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        schema = streaming["components"]["schemas"][name]
        schema["properties"]["stream"] = {"type": "boolean", "enum": [True]}
        schema["required"] = schema["required"] + ["stream"]
    return streaming


def _schemathesis(description: dict, port: int, workdir: Path, seed: int, seconds: int, paths: str,
                  mode: str = "all", whole_streams: bool = False) -> subprocess.Popen:
    """schemathesis in the background on the operations whose path matches the regex `paths`
    (a leading ! excludes them), for `seconds`; in `workdir`: its log, requests.har, its config.

    It reads 20 events of a stream, then hangs up: the API must take the client going away. With
    `whole_streams`, it reads every event, to see each stream through to its [DONE].
    """
    workdir.mkdir()
    (workdir / "openapi.json").write_text(json.dumps(description))
    if whole_streams:  # 64 choices x 128 tokens, each an event, at most
        (workdir / "schemathesis.toml").write_text("max-stream-events = 100000\n")
    select = ["--exclude-path-regex", paths[1:]] if paths.startswith("!") else ["--include-path-regex", paths]
    command = [sys.executable, "-m", "schemathesis.cli", "run", "openapi.json", *select,
               "--url", f"http://127.0.0.1:{port}", "--checks", ",".join(CHECKS), "--mode", mode,
               "--max-time", str(seconds), "--request-timeout", str(REQUEST_TIMEOUT_S),
               # One worker: hypothesis describing its strategies from two threads at once has
               # crashed here (SystemError in ast); the passes run as processes side by side instead.
               "--workers", "1", "--seed", str(seed), "--generation-database", "none",
               "--no-color", "--report", "har", "--report-har-path", "requests.har"]
    with open(workdir / "schemathesis.log", "w") as log:
        return subprocess.Popen(command, cwd=workdir, stdout=log, stderr=subprocess.STDOUT)


def _entries(workdir: Path) -> list[dict]:
    return json.loads((workdir / "requests.har").read_text())["log"]["entries"]


def _answers(entries: list[dict]) -> collections.Counter:
    """(method, route, status, media type) of every request sent, counted; a route as the
    description names it (/v1/files/{file_id}), a path it has not as sent."""
    routes = [(re.compile(re.sub(r"\{[^}]+\}", "[^/]+", path) + "$"), path) for path in document()["paths"]]

    def route(url: str) -> str:
        path = "/" + url.split("/", 3)[-1].split("?")[0]
        return next((name for pattern, name in routes if pattern.match(path)), path)

    return collections.Counter(
        (e["request"]["method"], route(e["request"]["url"]), e["response"]["status"],
         e["response"]["content"].get("mimeType", "").split(";")[0])
        for e in entries)


def _unfinished_streams(entries: list[dict], hung_up_after: int = 0) -> list[str]:
    """Streams that carry an error or stop before [DONE]: a failure a 200 status cannot show,
    and a stream that hangs (schemathesis cuts it at the request timeout without a word).
    `hung_up_after`: events after which schemathesis hung up itself (0: it never did)."""
    bad = []
    for e in entries:
        content = e["response"]["content"]
        if not content.get("mimeType", "").startswith("text/event-stream"):
            continue
        text = content.get("text", "")
        if content.get("encoding") == "base64":
            text = base64.b64decode(text).decode()
        cut = hung_up_after and text.count("data: ") >= hung_up_after
        if not (cut or text.endswith("data: [DONE]\n\n")) or '"error": {' in text:
            bad.append(f"{e['request'].get('postData', {}).get('text')}\n-> {text[-600:]}")
    return bad


@pytest.mark.slow
@pytest.mark.timeout(FUZZ_SECONDS + 150)
def test_the_running_api_answers_as_its_description_says(redis_server, tiny_model_dirs, tmp_path):
    redis_server.client().flushdb()  # no workers or queues left by other tests
    worker = tiny_worker(tiny_model_dirs["llama"], redis_server, tmp_path, "worker", "--batch", "16")
    port, api = start_api(redis_server, tmp_path, "api")
    passes: dict[str, subprocess.Popen] = {}
    try:
        wait_until(lambda: MODEL in models_served(port), [worker, api], f"/v1/models to list {MODEL}")
        status, served = get_json(f"http://127.0.0.1:{port}/openapi.json")
        assert status == 200
        _, listed = get_json(f"http://127.0.0.1:{port}/v1/models")
        context_window = next(m["context_window"] for m in listed["data"] if m["id"] == MODEL)
        narrowed = _narrowed(served, Known(context_window, *_seed_batches(port)))
        # Three passes side by side, so the costly routes (the model writes) get most of the time.
        passes = {
            "generate": _schemathesis(narrowed, port, tmp_path / "generate", 1, FUZZ_SECONDS, GENERATE),
            # positive only: a request without `stream` is valid, whatever this copy says
            "streams": _schemathesis(_streaming(narrowed), port, tmp_path / "streams", 2, FUZZ_SECONDS,
                                     GENERATE, mode="positive", whole_streams=True),
            "other-routes": _schemathesis(narrowed, port, tmp_path / "other-routes", 3, FUZZ_SECONDS // 2,
                                          "!" + GENERATE),
        }
        for proc in passes.values():
            proc.wait(timeout=FUZZ_SECONDS + 90)
        for name, proc in passes.items():
            output = (tmp_path / name / "schemathesis.log").read_text()
            assert proc.returncode == 0, (f"schemathesis ({name}) found problems:\n{output[-12000:]}\n"
                                          f"{logs(worker, api)}")
        assert worker.poll() is None and api.poll() is None, logs(worker, api)
    finally:
        for proc in passes.values():
            stop(proc)
        stop(api), stop(worker)
        redis_server.client().flushdb()  # the files and batches it made

    entries = {name: _entries(tmp_path / name) for name in passes}
    answers = {name: _answers(found) for name, found in entries.items()}
    sent = sum(len(found) for found in entries.values())
    print(f"schemathesis sent {sent} requests:", *sorted(sum(answers.values(), collections.Counter()).items()),
          sep="\n  ")
    assert sent >= LEAST_REQUESTS
    for path in ("/v1/completions", "/v1/chat/completions"):
        # The fuzzing got through to the worker (whole and streamed answers), and past the validation.
        assert answers["generate"]["POST", path, 200, "application/json"] >= 20
        assert answers["generate"]["POST", path, 400, "application/json"] >= 20
        assert answers["streams"]["POST", path, 200, "text/event-stream"] >= 20
    others = answers["other-routes"]
    for path in ("/v1/models", "/health", "/openapi.json", "/v1/files/{file_id}", "/v1/batches/{batch_id}"):
        assert others["GET", path, 200, "application/json"] >= 1
    assert others["GET", "/v1/files/{file_id}/content", 200, "application/jsonl"] >= 1
    for path in ("/v1/files", "/v1/batches", "/v1/batches/{batch_id}/cancel"):
        assert others["POST", path, 200, "application/json"] >= 1
    assert others["DELETE", "/v1/files/{file_id}", 200, "application/json"] >= 1
    described = {(method.upper(), path) for path, operations in document()["paths"].items()
                 for method in operations}
    tried = {(method, path) for method, path, _, _ in sum(answers.values(), collections.Counter())}
    assert described <= tried  # every operation was fuzzed
    unfinished = _unfinished_streams(entries["streams"]) + _unfinished_streams(entries["generate"], 20)
    assert not unfinished, "\n\n".join(unfinished[:5])
