"""Redis clients, made one way from REDIS_URL, and that URL as logs and printed lines may show it.

The URL carries everything a connection needs, and redis-py reads all of it, so no setting repeats it:
  redis://:PASSWORD@host:6379/0                        a password (Redis' requirepass)
  redis://USER:PASSWORD@host:6379/0                    an ACL user
  rediss://host:6380/0?ssl_ca_certs=/path/ca.pem       TLS, the server's certificate checked against a CA file
  rediss://...&ssl_certfile=c.pem&ssl_keyfile=c.key    a client certificate, for a server that asks for one
A password holding @ : / or % is percent-encoded in the URL (%40 for @).

Redis Sentinel (a primary, its replicas, and sentinels that promote a replica when the primary dies):
  redis+sentinel://[[USER]:PASSWORD@]host:26379[,host2:26379,...]/SERVICE[/DB][?sentinel_password=...]
The hosts are the sentinels (port 26379 unless given; [::1]:26379 for IPv6), SERVICE the name they
know the primary by (`sentinel monitor SERVICE ...`), DB the database (0). USER and PASSWORD are the
primary's (and its replicas'); `sentinel_password` is the sentinels' own requirepass, if they have one.
Every client is then redis-py's own `Sentinel(...).master_for(SERVICE)`: each new connection asks
the sentinels where the primary is now, so after a fail-over connections go to the promoted replica.
The commands that meet the fail-over fail with ConnectionError (MasterNotFoundError while the
sentinels agree on a new primary), which the API and the workers ride out as any Redis outage.

Redis Cluster (keys spread over the primaries by hash slot):
  redis+cluster://[[USER]:PASSWORD@]host:6379[,host2:6379,...][/0][?options]
  rediss+cluster://...?ssl_ca_certs=/path/ca.pem       the same over TLS
or a plain redis:// (rediss://) URL of any one node with REDIS_CLUSTER=1 (Settings turns it into the
first form). The hosts are where to start: any reachable one tells the client the whole cluster
(port 6379 unless given; [::1]:6379 for IPv6). A cluster has database 0 only. The options are those of
a redis:// URL, for every node. Every client is then redis-py's RedisCluster, which sends each command
to the primary of its key's slot; unlike the other forms it asks a node for the cluster's layout when
it is made, so connect() fails at once (ConnectionError) when no node answers. Which keys share a
slot, and why, is shared/keys.py's business; how results travel (sharded pub/sub) is api/broker.py's.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import parse_qs, unquote, urlsplit, urlunsplit

import redis
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import parse_url
from redis.exceptions import RedisClusterException
from redis.sentinel import Sentinel

MASK = "***"
SENTINEL_SCHEME = "redis+sentinel"
SENTINEL_PORT = 26379
# How long a question to one sentinel may take (unless the caller's socket timeouts say): a sentinel
# that is down or cut off must not hold up the next one in the list, nor a connection for long.
SENTINEL_TIMEOUT_S = 2.0

# A Redis Cluster URL's schemes, each with the scheme of one of its nodes (TLS or not).
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
CLUSTER_PORT = 6379

# Query options that hold a secret (redis-py passes `password` and `ssl_password` on as they are).
_SECRET_OPTION = re.compile(r"((?:^|&)(?:ssl_|sentinel_)?password=)[^&]*")
# The only query options a Sentinel URL takes: anything else is more likely a typo than a wish.
_SENTINEL_OPTIONS = {"sentinel_password"}


@dataclass(frozen=True)
class SentinelURL:
    """What a redis+sentinel:// URL says (the password never shown by repr)."""
    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_password: str | None = None

    def __repr__(self) -> str:
        hosts = ",".join(f"{h}:{p}" for h, p in self.sentinels)
        return f"SentinelURL({hosts}/{self.service}/{self.db})"


def is_sentinel(url: str) -> bool:
    return url.lower().startswith(SENTINEL_SCHEME + "://")


def parse_sentinel(url: str) -> SentinelURL:
    """The parts of a redis+sentinel:// URL; ValueError (without the password) if it is not one."""
    parts = urlsplit(url)
    if parts.scheme.lower() != SENTINEL_SCHEME:
        raise ValueError(f"not a {SENTINEL_SCHEME}:// URL: {masked(url)}")
    userinfo, at, hosts = parts.netloc.rpartition("@")
    sentinels = tuple(_host_port(h, url) for h in hosts.split(",") if h.strip())
    if not sentinels:
        raise ValueError(f"no sentinel host in {masked(url)}: give host:26379[,host2:26379...]")
    path = [p for p in parts.path.split("/") if p]
    if not path or len(path) > 2:
        raise ValueError(f"{masked(url)} names no service: end it with /SERVICE or /SERVICE/DB "
                         f"(the name in the sentinels' `sentinel monitor SERVICE ...`)")
    if len(path) == 2 and not path[1].isdigit():
        raise ValueError(f"the database in {masked(url)} is not a number: /SERVICE/DB, such as /mymaster/0")
    options = parse_qs(parts.query, keep_blank_values=True)
    unknown = sorted(set(options) - _SENTINEL_OPTIONS)
    if unknown:
        raise ValueError(f"{masked(url)}: unknown option(s) {', '.join(unknown)} (a Sentinel URL takes "
                         f"only {', '.join(sorted(_SENTINEL_OPTIONS))})")
    username, colon, password = userinfo.partition(":") if at else ("", "", "")
    return SentinelURL(
        sentinels=sentinels, service=unquote(path[0]), db=int(path[1]) if len(path) == 2 else 0,
        username=unquote(username) or None, password=unquote(password) if colon else None,
        sentinel_password=options.get("sentinel_password", [None])[-1] or None)


def _host_port(text: str, url: str, default_port: int = SENTINEL_PORT,
               what: str = "sentinel") -> tuple[str, int]:
    text = text.strip()
    if text.startswith("["):  # [IPv6]:port
        host, _, rest = text[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else rest
    else:
        host, _, port = text.rpartition(":") if ":" in text else (text, "", "")
    if not host or (port and not port.isdigit()):
        raise ValueError(f"bad {what} address {text!r} in {masked(url)}: give host:port")
    return host, int(port) if port else default_port


@dataclass(frozen=True)
class ClusterURL:
    """What a redis+cluster:// URL says: where to start, and one node's plain URL, which carries the
    password and the TLS and connection options for every node (its repr shows no password)."""
    nodes: tuple[tuple[str, int], ...]
    node_url: str

    def __repr__(self) -> str:
        hosts = ",".join(f"{h}:{p}" for h, p in self.nodes)
        return f"ClusterURL({hosts})"


def is_cluster(url: str) -> bool:
    return urlsplit(url).scheme.lower() in CLUSTER_SCHEMES


def as_cluster(url: str) -> str:
    """`url` as a Redis Cluster URL (REDIS_CLUSTER=1): redis:// -> redis+cluster://, rediss:// ->
    rediss+cluster://; a cluster URL as it is. ValueError for a URL that cannot name a cluster node."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme in CLUSTER_SCHEMES:
        return url
    if scheme not in CLUSTER_SCHEMES.values():
        raise ValueError(f"REDIS_CLUSTER=1 needs a redis:// or rediss:// URL of a cluster node, or a "
                         f"redis+cluster:// URL; got {masked(url)}")
    return urlunsplit(parts._replace(scheme=f"{scheme}+cluster"))


def parse_cluster(url: str) -> ClusterURL:
    """The parts of a redis+cluster:// URL; ValueError (without the password) if it is not one."""
    parts = urlsplit(url)
    scheme = CLUSTER_SCHEMES.get(parts.scheme.lower())
    if scheme is None:
        raise ValueError(f"not a redis+cluster:// URL: {masked(url)}")
    userinfo, at, hosts = parts.netloc.rpartition("@")
    nodes = tuple(_host_port(h, url, CLUSTER_PORT, "cluster node") for h in hosts.split(",") if h.strip())
    if not nodes:
        raise ValueError(f"no cluster node in {masked(url)}: give host:6379[,host2:6379...]")
    if parts.path.strip("/") not in ("", "0"):
        raise ValueError(f"{masked(url)}: a Redis Cluster has database 0 only (end the URL with /0 or "
                         f"nothing)")
    host, port = nodes[0]
    first = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    node_url = urlunsplit((scheme, f"{userinfo}@{first}" if at else first, "/0", parts.query, ""))
    if parse_url(node_url).get("db", 0) != 0:  # ?db=3
        raise ValueError(f"{masked(url)}: a Redis Cluster has database 0 only")
    return ClusterURL(nodes=nodes, node_url=node_url)


def connect(url: str, **options) -> redis.Redis:
    """A client for `url`; connections open on first use. Options the URL also names: the URL wins.

    For a redis+sentinel:// URL, a client of the current primary: the same options apply to its
    connections, and socket timeouts also to the questions asked of the sentinels.

    For a redis+cluster:// URL, redis-py's RedisCluster, the options applying to every node's
    connections (`connection_pool_class` makes each node's pool). It reads the cluster's layout from
    the first node that answers now: ConnectionError if none does (AuthenticationError: the password)."""
    if is_cluster(url):
        return _cluster(url, options)
    if not is_sentinel(url):
        return redis.Redis.from_url(url, **options)
    spec = parse_sentinel(url)
    # What redis-py itself would give the sentinels (the caller's socket_* options), with a timeout
    # where the caller sets none: the batch worker's client has none, and a sentinel that hangs must
    # not hang it.
    asking = {k: v for k, v in options.items() if k.startswith("socket_") and v is not None}
    asking.setdefault("socket_connect_timeout", SENTINEL_TIMEOUT_S)
    asking.setdefault("socket_timeout", SENTINEL_TIMEOUT_S)
    if spec.sentinel_password:
        asking["password"] = spec.sentinel_password
    primary = {**options, "db": spec.db}
    if spec.username:
        primary["username"] = spec.username
    if spec.password is not None:
        primary["password"] = spec.password
    return Sentinel(spec.sentinels, sentinel_kwargs=asking).master_for(spec.service, **primary)


class _Cluster(RedisCluster):
    """redis-py's RedisCluster, whose own errors (no node holds a key's slot while the cluster is
    failing over, none answers) are ConnectionErrors: every caller rides out a Redis outage by catching
    RedisError, and RedisClusterException is none."""

    def execute_command(self, *args, **kwargs):
        try:
            return super().execute_command(*args, **kwargs)
        except RedisClusterException as exc:
            raise redis.ConnectionError(f"Redis Cluster: {exc}") from exc


def _cluster(url: str, options: dict) -> RedisCluster:
    spec = parse_cluster(url)
    try:
        # Made from the first node's URL, so redis-py reads its password and TLS options itself (and
        # makes each node's pool with `connection_pool_class`, which it does only for a URL); the
        # other hosts are further places to start from.
        return _Cluster(url=spec.node_url, startup_nodes=[ClusterNode(h, p) for h, p in spec.nodes[1:]],
                            **options)
    except RedisClusterException as exc:
        # Its own exception, which is no RedisError: said as the outage it is, and without the URL's
        # password (redis-py's message names the nodes and their errors only).
        # A refused password stays an AuthenticationError, which explain() gives its hint.
        kind = redis.AuthenticationError if isinstance(exc.__cause__, redis.AuthenticationError) \
            else redis.ConnectionError
        raise kind(f"no node of the Redis Cluster at {masked(url)} answered: {exc}") from None


def is_cluster_client(client) -> bool:
    return isinstance(client, RedisCluster)


def get_many(client: redis.Redis, names: list) -> list:
    """MGET of keys that may lie in different hash slots: one MGET with one Redis, one per slot with
    a cluster (redis-py's mget_nonatomic; a cluster's MGET must keep to one slot)."""
    if not names:
        return []
    if is_cluster_client(client):
        return client.mget_nonatomic(names)
    return client.mget(names)


def server_time(client: redis.Redis, near: str) -> tuple[int, int]:
    """Redis' TIME, from the server that holds the key `near` (a cluster's nodes each have their own
    clock: the one that stamps a model's jobs is that of its keys' node)."""
    if is_cluster_client(client):
        return client.time(target_nodes=client.get_node_from_key(near))
    return client.time()


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


# What redis-py's BlockingConnectionPool raises when its wait for a free connection runs out.
POOL_RAN_DRY = "No connection available."


def unavailable_because(exc: redis.RedisError) -> str:
    """The 503's message for a Redis error met serving a request: Redis unreachable, or this process's
    connections all busy past the pool's wait (reachable, but a burst beyond what it takes in)."""
    if isinstance(exc, redis.ConnectionError) and str(exc) == POOL_RAN_DRY:
        return ("the job queue (Redis) is busy: every Redis connection of this API process stayed in use "
                "past its wait (more requests at once than it takes in: raise --redis-connections or run "
                "more API processes)")
    return f"the job queue (Redis) is not reachable: {explain(exc)}"
