"""Redis clients, made one way from REDIS_URL, and that URL as logs and printed lines may show it.

The URL carries everything a connection needs, and redis-py reads all of it, so no setting repeats it:
  redis://:PASSWORD@host:6379/0                        a password (Redis' requirepass)
  redis://USER:PASSWORD@host:6379/0                    an ACL user
  rediss://host:6380/0?ssl_ca_certs=/path/ca.pem       TLS, the server's certificate checked against a CA file
  rediss://...&ssl_certfile=c.pem&ssl_keyfile=c.key    a client certificate, for a server that asks for one
A password holding @ : / or % is percent-encoded in the URL (%40 for @).
"""
from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

import redis

MASK = "***"

# Query options that hold a secret (redis-py passes `password` and `ssl_password` on as they are).
_SECRET_OPTION = re.compile(r"((?:^|&)(?:ssl_)?password=)[^&]*")


def connect(url: str, **options) -> redis.Redis:
    """A client for `url`; connections open on first use. Options the URL also names: the URL wins."""
    return redis.Redis.from_url(url, **options)


def masked(url: str) -> str:
    """`url` with any password replaced by ***: the only form of a Redis URL that is ever printed."""
    parts = urlsplit(url)
    netloc, query = parts.netloc, _SECRET_OPTION.sub(rf"\g<1>{MASK}", parts.query)
    userinfo, at, host = netloc.rpartition("@")
    if at and ":" in userinfo:
        netloc = f"{userinfo.partition(':')[0]}:{MASK}@{host}"
    if (netloc, query) == (parts.netloc, parts.query):
        return url  # nothing secret: exactly as given
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def explain(exc: redis.RedisError) -> str:
    """What went wrong talking to Redis, with a hint when it is the password (never the password)."""
    if isinstance(exc, redis.AuthenticationError):
        return f"{exc} (check the password: REDIS_URL carries it as redis://:PASSWORD@host:port/0)"
    return str(exc)
