"""Files of the batch API: an uploaded batch input, a batch's output and errors.

A file's object (OpenAI's shape: id, bytes, filename, purpose, created_at) is a Redis hash in every
case, so the API processes and the batch worker agree on which files exist; the bytes are in Redis
too, or, with --files-dir, in that directory (a volume both mount), which keeps large files out of
Redis' memory.
"""
from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Optional

import redis

from shared import keys

# OpenAI's purposes that matter here: what a client uploads, what a batch writes.
PURPOSE_INPUT, PURPOSE_OUTPUT = "batch", "batch_output"


class FileStore:
    def __init__(self, client: redis.Redis, files_dir: str = ""):
        self.redis = client
        self.dir = Path(files_dir).expanduser() if files_dir else None
        if self.dir:
            self.dir.mkdir(parents=True, exist_ok=True)

    def create(self, content: bytes, filename: str, purpose: str, extra: Optional[dict] = None) -> dict:
        """Store `content`; `extra` (JSON-able) is kept beside the object, for the batch API's own use."""
        file_id = f"file-{uuid.uuid4().hex[:24]}"
        record = {"id": file_id, "object": "file", "bytes": len(content), "created_at": int(time.time()),
                  "filename": filename, "purpose": purpose, "extra": json.dumps(extra or {})}
        if self.dir:
            # Written under a temporary name and renamed: a reader never sees half a file.
            partial = self.dir / f".{file_id}.partial"
            partial.write_bytes(content)
            os.replace(partial, self._path(file_id))
            self.redis.hset(keys.file(file_id), mapping=record)
        else:
            pipe = self.redis.pipeline(transaction=True)
            pipe.set(keys.file_content(file_id), content)
            pipe.hset(keys.file(file_id), mapping=record)
            pipe.execute()
        return self._public(record)

    def get(self, file_id: str) -> Optional[dict]:
        """The file's object as the API shows it, or None."""
        record = self._record(file_id)
        return self._public(record) if record else None

    def extra(self, file_id: str) -> Optional[dict]:
        record = self._record(file_id)
        return json.loads(record["extra"]) if record else None

    def content(self, file_id: str) -> Optional[bytes]:
        if not self.redis.exists(keys.file(file_id)):
            return None
        if self.dir:
            try:
                return self._path(file_id).read_bytes()
            except FileNotFoundError:
                return None
        return self.redis.get(keys.file_content(file_id))

    def delete(self, file_id: str) -> bool:
        removed = self.redis.delete(keys.file(file_id), keys.file_content(file_id)) > 0
        if self.dir and removed:
            self._path(file_id).unlink(missing_ok=True)
        return removed

    def _record(self, file_id: str) -> Optional[dict]:
        raw = self.redis.hgetall(keys.file(file_id))
        return {k.decode(): v.decode() for k, v in raw.items()} if raw else None

    def _path(self, file_id: str) -> Path:
        # Ids come from URLs: only ours (file- and hex) ever name a path, never ../something.
        if not (file_id.startswith("file-") and file_id[5:].isalnum()):
            raise ValueError(f"not a file id: {file_id!r}")
        return self.dir / f"{file_id}.jsonl"

    @staticmethod
    def _public(record: dict) -> dict:
        return {"id": record["id"], "object": "file", "bytes": int(record["bytes"]),
                "created_at": int(record["created_at"]), "filename": record["filename"],
                "purpose": record["purpose"], "status": "processed", "expires_at": None}
