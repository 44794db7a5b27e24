"""The batch API's routes, in OpenAI's shape: files in, a batch run by RQ, files out.

  POST /v1/files                    upload a JSONL of requests (multipart: file, purpose=batch)
  GET  /v1/files/{id}               the file's object;  GET .../content: its bytes;  DELETE: gone
  POST /v1/batches                  run a file's requests (input_file_id, endpoint, completion_window)
  GET  /v1/batches/{id}             status, request_counts, output_file_id, error_file_id, times
  POST /v1/batches/{id}/cancel      stop sending its requests; what was answered is kept

A batch is one RQ job on keys.BATCH_QUEUE, which `python -m batch` runs (batch/job.py). RQ does not
work with a Redis Cluster (its worker wants one server's connection pool, its keys no hash tags):
there, files still upload, but a new batch is refused with 501.
"""
from __future__ import annotations

import contextlib

import redis
from flask import Blueprint, Response, jsonify, request
from rq import Callback, Queue, Retry

from api.batch_input import ENDPOINTS, parse_file
from api.batch_store import COMPLETION_WINDOWS, BatchStore
from api.errors import ApiError, bad_request
from api.file_store import PURPOSE_INPUT, FileStore
from api.validation import get_field
from shared import keys
from shared.redis_client import is_cluster_client
from shared.settings import Settings

MULTIPART_SLACK = 64 * 1024  # a multipart body is the file plus its boundaries and other fields
MAX_METADATA = 16            # OpenAI's limits on a batch's metadata
MAX_METADATA_KEY, MAX_METADATA_VALUE = 64, 512
RQ_RETRIES = 2               # reruns of a batch job whose RQ worker died; each resumes where it stopped
RESULT_TTL_S, FAILURE_TTL_S = 24 * 3600, 7 * 24 * 3600  # how long RQ keeps its own job records


def blueprint(settings: Settings, client: redis.Redis) -> Blueprint:
    files = FileStore(client, settings.files_dir)
    batches = BatchStore(client)
    queue = Queue(keys.BATCH_QUEUE, connection=client)
    limit = settings.batch_file_limit * 1024 * 1024
    bp = Blueprint("batches", __name__)

    def too_large() -> ApiError:
        return ApiError(413, f"the file is larger than this API takes ({settings.batch_file_limit} MiB, "
                             f"--batch-file-limit): split it into several batches", param="file",
                        code="file_too_large")

    @bp.post("/v1/files")
    def upload():
        if request.content_length is not None and request.content_length > limit + MULTIPART_SLACK:
            raise too_large()  # before reading any of it
        request.max_content_length = limit + MULTIPART_SLACK  # this route only: the app's cap is 4 MiB
        purpose = request.form.get("purpose")
        if purpose is None:
            raise bad_request("you must provide 'purpose' (\"batch\")", param="purpose",
                              code="missing_required_parameter")
        if purpose != PURPOSE_INPUT:
            raise bad_request(f"'purpose' must be \"batch\": this API takes batch input files only, "
                              f"got {purpose!r}", param="purpose", code="invalid_value")
        upload = request.files.get("file")
        if upload is None:
            raise bad_request("you must provide 'file' (multipart/form-data: a JSONL of requests)",
                              param="file", code="missing_required_parameter")
        content = upload.read(limit + 1)
        if len(content) > limit:
            raise too_large()
        lines = parse_file(content, settings.lenient)
        extra = {"requests": len(lines), "urls": sorted({line.url for line in lines})}
        return jsonify(files.create(content, upload.filename or "batch.jsonl", purpose, extra))

    def file_or_404(file_id: str) -> dict:
        return _found(files.get(file_id), "File", file_id)

    @bp.get("/v1/files/<file_id>")
    def file_object(file_id: str):
        return jsonify(file_or_404(file_id))

    @bp.get("/v1/files/<file_id>/content")
    def file_content(file_id: str):
        content = files.content(file_id)
        if content is None:
            _found(None, "File", file_id)  # the same 404, whichever part is missing
        return Response(content, mimetype="application/jsonl")

    @bp.delete("/v1/files/<file_id>")
    def delete_file(file_id: str):
        file_or_404(file_id)
        files.delete(file_id)
        return jsonify({"id": file_id, "object": "file", "deleted": True})

    @bp.post("/v1/batches")
    def create_batch():
        if is_cluster_client(client):
            raise ApiError(501, "batches run on RQ, which does not work with a Redis Cluster: run the batch "
                                "API against one Redis (or Sentinel), or send the requests to /v1 yourself",
                           code="unsupported_with_redis_cluster")
        body = request.get_json(force=True, silent=True)
        if not isinstance(body, dict):
            raise bad_request("the body must be a JSON object: {\"input_file_id\", \"endpoint\", "
                              "\"completion_window\": \"24h\"}", code="invalid_json")
        input_file_id = _field(body, "input_file_id", required=True)
        endpoint = _field(body, "endpoint", required=True)
        if endpoint not in ENDPOINTS:
            raise bad_request(f"'endpoint' must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}",
                              param="endpoint", code="invalid_value")
        window = _field(body, "completion_window", default="24h")
        if window not in COMPLETION_WINDOWS:
            raise bad_request(f"'completion_window' must be \"24h\", got {window!r}", param="completion_window",
                              code="invalid_value")
        metadata = _metadata(body.get("metadata"))
        found, extra = files.get(input_file_id), files.extra(input_file_id)
        if found is None:
            raise bad_request(f"the input file {input_file_id} does not exist: upload it to /v1/files first",
                              param="input_file_id", code="file_not_found")
        if found["purpose"] != PURPOSE_INPUT:
            raise bad_request(f"the file {input_file_id} is a {found['purpose']} file, not a batch input",
                              param="input_file_id", code="invalid_value")
        others = [url for url in extra["urls"] if url != endpoint]
        if others:
            raise bad_request(f"the file's requests go to {', '.join(others)}, but the batch's endpoint is "
                              f"{endpoint}: every line's url must be the endpoint", param="endpoint",
                              code="invalid_value")
        batch_id = batches.create(input_file_id, endpoint, window, extra["requests"], metadata)
        try:
            queue.enqueue_call("batch.job.run_batch", args=(batch_id,), job_id=batch_id,
                               timeout=COMPLETION_WINDOWS[window] + 3600, result_ttl=RESULT_TTL_S,
                               failure_ttl=FAILURE_TTL_S, retry=Retry(max=RQ_RETRIES),
                               on_failure=Callback("batch.job.on_failure"), description=f"batch {batch_id}")
        except redis.RedisError:
            with contextlib.suppress(redis.RedisError):  # best effort: Redis is likely down
                batches.move(batch_id, ("validating",), "failed")
            raise
        return jsonify(batches.get(batch_id))

    def batch_or_404(batch_id: str) -> dict:
        return _found(batches.get(batch_id), "Batch", batch_id)

    @bp.get("/v1/batches/<batch_id>")
    def batch_object(batch_id: str):
        return jsonify(batch_or_404(batch_id))

    @bp.post("/v1/batches/<batch_id>/cancel")
    def cancel_batch(batch_id: str):
        batch_or_404(batch_id)
        accepted, found = batches.cancel(batch_id)
        if not accepted and found not in ("cancelling", "cancelled"):  # cancelling twice is no mistake
            raise ApiError(409, f"the batch is {found}: only a validating or in-progress batch can be cancelled",
                           param="batch_id", code="batch_not_cancellable")
        return jsonify(batch_or_404(batch_id))

    return bp


def _found(record, kind: str, record_id: str) -> dict:
    """The record, or a 404 naming it (`File` -> param file_id, code file_not_found)."""
    if record is None:
        name = kind.lower()
        raise ApiError(404, f"No such {kind} object: {record_id}", param=f"{name}_id", code=f"{name}_not_found")
    return record


def _field(body: dict, name: str, required: bool = False, default=None) -> str:
    value = get_field(body, name, str, default, required=required)
    if value is not None:
        try:  # a \ud800 escape decodes to a lone surrogate, which no Redis key takes
            value.encode()
        except UnicodeEncodeError:
            raise bad_request(f"'{name}' holds a lone surrogate (\\ud800-\\udfff): not valid Unicode",
                              param=name, code="invalid_value")
    return value


def _metadata(metadata) -> dict | None:
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise bad_request("'metadata' must be an object of strings", param="metadata", code="invalid_type")
    if len(metadata) > MAX_METADATA or any(len(k) > MAX_METADATA_KEY or len(v) > MAX_METADATA_VALUE
                                           for k, v in metadata.items()):
        raise bad_request(f"'metadata' takes at most {MAX_METADATA} pairs, keys of at most {MAX_METADATA_KEY} "
                          f"characters and values of at most {MAX_METADATA_VALUE}", param="metadata",
                          code="invalid_value")
    return metadata
