"""REDIS_URL's Sentinel and Cluster forms: parsing, the password never shown, the client it makes,
serve.py's refusal to start a Redis for it. (No server here: tests/test_sentinel.py and
tests/test_cluster.py run real ones.)"""
from __future__ import annotations

import pytest
import redis
from redis.sentinel import SentinelConnectionPool

from serve import ensure_redis
from shared.redis_client import (SENTINEL_TIMEOUT_S, ClusterURL, SentinelURL, as_cluster, connect, is_cluster,
                                 is_sentinel, masked, parse_cluster, parse_sentinel)
from shared.settings import Settings
from tests.processes import free_port

PASSWORD = "s3cret-Pa55 word"
QUOTED = PASSWORD.replace(" ", "%20")


@pytest.mark.parametrize("url, expected", [
    ("redis+sentinel://h:26379/mymaster", SentinelURL((("h", 26379),), "mymaster")),
    ("redis+sentinel://a,b:26380, c:1/svc/3", SentinelURL((("a", 26379), ("b", 26380), ("c", 1)), "svc", 3)),
    (f"redis+sentinel://:{QUOTED}@10.0.0.5:26379/mymaster/0",
     SentinelURL((("10.0.0.5", 26379),), "mymaster", 0, None, PASSWORD)),
    (f"redis+sentinel://game:{QUOTED}@h/m?sentinel_password=p%40ss",
     SentinelURL((("h", 26379),), "m", 0, "game", PASSWORD, "p@ss")),
    ("redis+sentinel://[::1]:26380,[fe80::1]/m/1", SentinelURL((("::1", 26380), ("fe80::1", 26379)), "m", 1)),
    ("REDIS+SENTINEL://h/my%20master", SentinelURL((("h", 26379),), "my master")),
])
def test_a_sentinel_url_names_the_sentinels_service_db_and_passwords(url, expected):
    assert is_sentinel(url)
    assert parse_sentinel(url) == expected


@pytest.mark.parametrize("url, words", [
    ("redis+sentinel:///mymaster", "no sentinel host"),
    ("redis+sentinel://h:26379", "names no service"),
    ("redis+sentinel://h:26379/", "names no service"),
    ("redis+sentinel://h/m/0/extra", "names no service"),
    ("redis+sentinel://h/m/zero", "not a number"),
    ("redis+sentinel://h:port/m", "bad sentinel address"),
    (f"redis+sentinel://:{QUOTED}@h/m?ssl=true&socket_timeout=1", "unknown option(s) socket_timeout, ssl"),
])
def test_a_malformed_sentinel_url_is_refused_without_its_password(url, words):
    _refused_without_password(url, words)


def _refused_without_password(url: str, words: str) -> None:
    with pytest.raises(ValueError) as caught:
        connect(url)
    assert words in str(caught.value) and "s3cret" not in str(caught.value)


def test_the_parts_repr_shows_no_password():
    shown = repr(parse_sentinel(f"redis+sentinel://:{QUOTED}@h/m?sentinel_password={QUOTED}"))
    assert "s3cret" not in shown and "h:26379/m/0" in shown


@pytest.mark.parametrize("url, shown", [
    ("redis+sentinel://h1:26379,h2:26379/mymaster/0", "redis+sentinel://h1:26379,h2:26379/mymaster/0"),
    (f"redis+sentinel://:{QUOTED}@h1:26379,h2:26379/mymaster/0",
     "redis+sentinel://:***@h1:26379,h2:26379/mymaster/0"),
    (f"redis+sentinel://game:{QUOTED}@h/m?sentinel_password={QUOTED}",
     "redis+sentinel://game:***@h/m?sentinel_password=***"),
    ("redis+sentinel://[::1]:26379/m", "redis+sentinel://[::1]:26379/m"),
])
def test_masked_hides_the_passwords_of_a_sentinel_url(url, shown):
    assert masked(url) == shown


def test_other_urls_are_not_sentinel_urls():
    for url in ("redis://h:6379/0", "rediss://h/0", "unix:///tmp/r.sock", "redis+sentinelx://h/m"):
        assert not is_sentinel(url)
    assert isinstance(connect("redis://127.0.0.1:6379/0").connection_pool, redis.ConnectionPool)
    assert not isinstance(connect("redis://127.0.0.1:6379/0").connection_pool, SentinelConnectionPool)


def test_connect_makes_a_client_of_the_primary_through_redis_pys_sentinel():
    url = f"redis+sentinel://game:{QUOTED}@h1,h2:26380/svc/2?sentinel_password=sp"
    client = connect(url, socket_connect_timeout=1, socket_timeout=5, max_connections=9)
    pool = client.connection_pool
    assert isinstance(pool, SentinelConnectionPool) and pool.is_master and pool.service_name == "svc"
    assert pool.max_connections == 9
    kwargs = pool.connection_kwargs
    assert (kwargs["db"], kwargs["username"], kwargs["password"]) == (2, "game", PASSWORD)
    assert (kwargs["socket_connect_timeout"], kwargs["socket_timeout"]) == (1, 5)
    # The sentinels are asked with the caller's socket timeouts, and their own password.
    asked = [s.connection_pool.connection_kwargs for s in pool.sentinel_manager.sentinels]
    assert [(a["host"], a["port"]) for a in asked] == [("h1", 26379), ("h2", 26380)]
    assert all((a["socket_connect_timeout"], a["socket_timeout"], a["password"]) == (1, 5, "sp") for a in asked)
    assert "password" not in connect("redis+sentinel://h/m").connection_pool.connection_kwargs


def test_sentinels_get_a_timeout_when_the_caller_sets_none():
    # The batch worker's client sets no timeout: a sentinel that hangs must not hang it.
    asked = connect("redis+sentinel://h/m").connection_pool.sentinel_manager.sentinels[0]
    kwargs = asked.connection_pool.connection_kwargs
    assert kwargs["socket_connect_timeout"] == kwargs["socket_timeout"] == SENTINEL_TIMEOUT_S


@pytest.mark.timeout(30)
def test_no_sentinel_answering_is_a_connection_error_and_serve_starts_nothing():
    url = f"redis+sentinel://:{QUOTED}@127.0.0.1:{free_port()}/mymaster/0"
    with pytest.raises(redis.ConnectionError) as caught:
        connect(url, socket_connect_timeout=1).ping()
    assert "No master found for 'mymaster'" in str(caught.value)
    with pytest.raises(SystemExit) as caught:
        ensure_redis(url)
    assert "Sentinel" in str(caught.value) and ":***@" in str(caught.value) and "s3cret" not in str(caught.value)


@pytest.mark.parametrize("url, expected", [
    ("redis+cluster://h:7000", ClusterURL((("h", 7000),), "redis://h:7000/0")),
    ("redis+cluster://a, b:7001 ,c/0", ClusterURL((("a", 6379), ("b", 7001), ("c", 6379)), "redis://a:6379/0")),
    (f"redis+cluster://game:{QUOTED}@10.0.0.5:7000,10.0.0.6:7000/",
     ClusterURL((("10.0.0.5", 7000), ("10.0.0.6", 7000)), f"redis://game:{QUOTED}@10.0.0.5:7000/0")),
    ("rediss+cluster://[::1]:7000,h?ssl_ca_certs=/ca.pem",
     ClusterURL((("::1", 7000), ("h", 6379)), "rediss://[::1]:7000/0?ssl_ca_certs=/ca.pem")),
    ("REDIS+CLUSTER://h", ClusterURL((("h", 6379),), "redis://h:6379/0")),
])
def test_a_cluster_url_names_where_to_start_and_one_nodes_plain_url(url, expected):
    assert is_cluster(url) and not is_sentinel(url)
    assert parse_cluster(url) == expected


@pytest.mark.parametrize("url, words", [
    ("redis+cluster:///0", "no cluster node"),
    ("redis+cluster://h/1", "database 0 only"),
    (f"redis+cluster://:{QUOTED}@h?db=2", "database 0 only"),
    (f"redis+cluster://:{QUOTED}@h:port", "bad cluster node address"),
])
def test_a_malformed_cluster_url_is_refused_without_its_password(url, words):
    _refused_without_password(url, words)


def test_a_cluster_urls_password_is_masked_and_its_repr_shows_none():
    url = f"rediss+cluster://game:{QUOTED}@h1:7000,h2:7000/0?ssl_password={QUOTED}"
    assert masked(url) == "rediss+cluster://game:***@h1:7000,h2:7000/0?ssl_password=***"
    assert "s3cret" not in repr(parse_cluster(url)) and "h1:7000,h2:7000" in repr(parse_cluster(url))


def test_redis_cluster_1_turns_a_nodes_url_into_a_cluster_url(monkeypatch):
    assert as_cluster("redis://:pw@h:7000/0") == "redis+cluster://:pw@h:7000/0"
    assert as_cluster("rediss://h:7000") == "rediss+cluster://h:7000"
    assert as_cluster("redis+cluster://h") == "redis+cluster://h"
    monkeypatch.setenv("REDIS_URL", "redis://h:7000/0")
    monkeypatch.setenv("REDIS_CLUSTER", "1")
    assert Settings.from_env().redis_url == "redis+cluster://h:7000/0"
    assert Settings.parse(["--redis-url", "redis://g:1"], ["redis_url"], "").redis_url == "redis+cluster://g:1"
    monkeypatch.setenv("REDIS_CLUSTER", "0")
    assert Settings.from_env().redis_url == "redis://h:7000/0"
    monkeypatch.setenv("REDIS_CLUSTER", "yes")
    monkeypatch.setenv("REDIS_URL", f"redis+sentinel://:{QUOTED}@h/m")
    with pytest.raises(SystemExit) as caught:
        Settings.from_env()
    assert "REDIS_CLUSTER=1" in str(caught.value) and "s3cret" not in str(caught.value)


@pytest.mark.timeout(30)
def test_no_cluster_node_answering_is_a_connection_error_and_serve_starts_nothing():
    url = f"redis+cluster://:{QUOTED}@127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    with pytest.raises(redis.ConnectionError) as caught:
        connect(url, socket_connect_timeout=1)
    assert ":***@" in str(caught.value) and "s3cret" not in str(caught.value)
    with pytest.raises(SystemExit) as caught:
        ensure_redis(url)
    assert "Cluster" in str(caught.value) and ":***@" in str(caught.value) and "s3cret" not in str(caught.value)
