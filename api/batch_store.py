"""Batch records in Redis, in OpenAI's Batch object shape, shared by the API and the batch worker.

A batch is a hash: its fields as strings, its request counts as numbers the batch job HINCRBYs as
requests finish, so GET /v1/batches/{id} shows progress. A status changes only by compare-and-set
(a Lua script), because two parties change it: the batch job moves it forward, a client's cancel
moves it aside; whichever comes second sees the other's status and acts on it.

  validating -> in_progress -> finalizing -> completed
  validating -> failed (the input file vanished)       in_progress -> expired (past the 24 h window)
  validating -> cancelled (the job had not started)    in_progress -> cancelling -> cancelled
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Optional

import redis

from shared import keys

COMPLETION_WINDOWS = {"24h": 24 * 3600}  # OpenAI's only window
CANCELLABLE = ("validating", "in_progress")
DONE = ("completed", "failed", "expired", "cancelled")
_TIMES = ("created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at",
          "expired_at", "cancelling_at", "cancelled_at")
_IDS = ("output_file_id", "error_file_id")

# KEYS[1]: the batch. ARGV: statuses allowed now (comma-separated), the new status, then field/value
# pairs to set with it. Returns {1, old status} when moved, {0, current status} when not.
_MOVE = """
local now = redis.call('HGET', KEYS[1], 'status')
if not now then return {0, ''} end
for allowed in string.gmatch(ARGV[1], '[^,]+') do
  if allowed == now then
    redis.call('HSET', KEYS[1], 'status', ARGV[2], unpack(ARGV, 3))
    return {1, now}
  end
end
return {0, now}
"""


class BatchStore:
    def __init__(self, client: redis.Redis):
        self.redis = client
        self._move = client.register_script(_MOVE)

    def create(self, input_file_id: str, endpoint: str, completion_window: str, total: int,
               metadata: Optional[dict]) -> str:
        batch_id = f"batch_{uuid.uuid4().hex[:24]}"
        now = int(time.time())
        self.redis.hset(keys.batch(batch_id), mapping={
            "id": batch_id, "endpoint": endpoint, "input_file_id": input_file_id,
            "completion_window": completion_window, "status": "validating", "created_at": now,
            "expires_at": now + COMPLETION_WINDOWS[completion_window], "total": total,
            "completed": 0, "failed": 0, "metadata": json.dumps(metadata)})
        return batch_id

    def get(self, batch_id: str) -> Optional[dict]:
        """The batch as OpenAI's Batch object, or None."""
        raw = self.redis.hgetall(keys.batch(batch_id))
        if not raw:
            return None
        r = {k.decode(): v.decode() for k, v in raw.items()}
        batch = {"id": r["id"], "object": "batch", "endpoint": r["endpoint"],
                 "errors": json.loads(r["errors"]) if "errors" in r else None,
                 "input_file_id": r["input_file_id"], "completion_window": r["completion_window"],
                 "status": r["status"]}
        batch.update({name: r.get(name) for name in _IDS})
        batch.update({name: int(r[name]) if name in r else None for name in _TIMES})
        batch["request_counts"] = {"total": int(r["total"]), "completed": int(r["completed"]),
                                   "failed": int(r["failed"])}
        batch["metadata"] = json.loads(r["metadata"])
        return batch

    def status(self, batch_id: str) -> Optional[str]:
        status = self.redis.hget(keys.batch(batch_id), "status")
        return status.decode() if status else None

    def move(self, batch_id: str, allowed: tuple[str, ...], status: str, **fields) -> tuple[bool, str]:
        """Set `status` (and `{status}_at`, and `fields`) if the status now is one of `allowed`.
        Returns whether it moved, and the status it found."""
        fields.setdefault(f"{status}_at", int(time.time()))
        pairs = [str(item) for name_value in fields.items() for item in name_value]
        moved, found = self._move(keys=[keys.batch(batch_id)], args=[",".join(allowed), status, *pairs])
        return bool(moved), found.decode() if isinstance(found, bytes) else found

    def record(self, batch_id: str, index: int, line: dict, ok: bool) -> None:
        """Request `index` finished: its output line kept, one more `completed` (a 2xx) or `failed`,
        together (MULTI), so a job run again after a crash counts each request once."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(keys.batch_results(batch_id), str(index), json.dumps(line))
        pipe.hincrby(keys.batch(batch_id), "completed" if ok else "failed", 1)
        pipe.execute()

    def results(self, batch_id: str) -> dict[int, dict]:
        raw = self.redis.hgetall(keys.batch_results(batch_id))
        return {int(index): json.loads(line) for index, line in raw.items()}

    def done_indexes(self, batch_id: str) -> set[int]:
        return {int(index) for index in self.redis.hkeys(keys.batch_results(batch_id))}

    def forget_results(self, batch_id: str) -> None:
        self.redis.delete(keys.batch_results(batch_id))

    def cancel(self, batch_id: str) -> tuple[bool, str]:
        """A client's cancel. A batch whose job has not started is cancelled at once; a running one
        is marked cancelling, which its job sees between requests. Returns (accepted, status found)."""
        now = int(time.time())
        moved, found = self.move(batch_id, ("validating",), "cancelled", cancelling_at=now)
        if moved:
            return True, found
        return self.move(batch_id, ("in_progress",), "cancelling")
