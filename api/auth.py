"""Who may call the API, and how often: API keys (`Authorization: Bearer <key>`) and a rate limit.

Both guard /v1 only: /health, /openapi.json and /metrics stay open to load balancers and scrapers.
The limit is a fixed one-minute window per key (per client address when there are no keys), counted
in Redis so that it holds across API processes and machines.
"""
from __future__ import annotations

import hashlib
import hmac
import math
import time
from pathlib import Path
from typing import Optional

import redis
from flask import Flask, request

from api.errors import ApiError, too_many
from shared import keys
from shared.settings import Settings

GUARDED_PREFIX = "/v1"
WINDOW_S = 60


def load_keys(settings: Settings) -> list[str]:
    """The configured keys: --api-keys (comma-separated) and --api-keys-file (one a line, # comments)."""
    found = [key.strip() for key in settings.api_keys.split(",")]
    if settings.api_keys_file:
        path = Path(settings.api_keys_file).expanduser()
        try:
            lines = path.read_text().splitlines()
        except OSError as exc:
            raise SystemExit(f"--api-keys-file {path}: {exc.strerror}")
        found += [line.strip() for line in lines if not line.strip().startswith("#")]
    return [key for key in found if key]


def _digest(text: str) -> bytes:
    # Keys are held and compared as digests: every comparison has the same length, whatever was sent.
    return hashlib.sha256(text.encode()).digest()


def _bearer(header: Optional[str]) -> Optional[str]:
    scheme, _, token = (header or "").strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


class Gate:
    """A before-request check: 401 without a known key, 429 past the rate limit."""

    def __init__(self, client: redis.Redis, known_keys: list[str], per_minute: int):
        self.redis = client
        self.known = [_digest(key) for key in known_keys]
        self.per_minute = per_minute

    @property
    def active(self) -> bool:
        return bool(self.known or self.per_minute)

    def check(self) -> None:
        if request.path != GUARDED_PREFIX and not request.path.startswith(GUARDED_PREFIX + "/"):
            return
        caller = self._caller()
        if self.per_minute:
            self._count(caller)

    def _caller(self) -> str:
        """Who is calling, as a short digest (Redis sees no key, not even in a key name)."""
        if not self.known:
            return _digest(f"address {request.remote_addr}").hex()[:16]
        sent = _bearer(request.headers.get("Authorization"))
        if sent is None:
            raise ApiError(401, "You didn't provide an API key. Send it in an Authorization header "
                                "using Bearer auth ('Authorization: Bearer YOUR_KEY').", code="invalid_api_key")
        digest = _digest(sent)
        matched = False
        for known in self.known:  # every key, always: the time taken says nothing about which matched
            matched |= hmac.compare_digest(digest, known)
        if not matched:
            raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")
        return digest.hex()[:16]

    def _count(self, caller: str) -> None:
        # The local clock names the window: API machines are assumed to agree on the minute.
        now = time.time()
        minute = int(now // WINDOW_S)
        name = keys.rate(caller, minute)
        pipe = self.redis.pipeline(transaction=True)  # one round trip; the count always gets its TTL
        pipe.incr(name)
        pipe.expire(name, WINDOW_S)
        count, _ = pipe.execute()
        if count > self.per_minute:
            retry_after = max(1, math.ceil((minute + 1) * WINDOW_S - now))
            per = "API key" if self.known else "client address"
            raise too_many(f"Rate limit reached: {self.per_minute} requests per minute per {per}. "
                           f"Try again in {retry_after} s.", code="rate_limit_exceeded", retry_after=retry_after)


def install(app: Flask, settings: Settings, client: redis.Redis) -> None:
    """Guard `app`'s /v1 routes as the settings say; with no keys and no limit, nothing is added."""
    gate = Gate(client, load_keys(settings), settings.rate_limit)
    if gate.active:
        app.before_request(gate.check)
