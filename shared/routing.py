"""Where a conversation's history is cached: the chain of digests a prompt's leading blocks make.

A player's next turn repeats the whole conversation so far, and the worker that wrote the last turn
holds it in its prefix cache. The API cannot see the workers' caches; instead each answered job leaves
a note in Redis, keys.route(model, digest) -> the worker that wrote it, where digest names the job's
prompt up to its last full block (`chain(...)[-1]`). The next turn's prompt starts with that prompt,
so one of its own chain's digests is that note's: the API reads them all in one MGET and offers the
job to the worker of the deepest note found (api/routing.py). A note is a hint: a worker that has
since evicted those blocks only costs the offer's short wait (--affinity-wait), never a wrong answer.

Each digest hashes the one before it and the next block's token ids, so it names the whole prefix,
not one block (as the workers' prefix cache does). The chain is seeded with the request's routing key
(OpenAI's `prompt_cache_key`, else `user`): two players whose prompts start alike (a shared system
prompt) keep apart, and a conversation's turns stay together.
"""
from __future__ import annotations

import hashlib
from array import array

ROUTE_BLOCK = 16  # tokens a link of the chain covers: the workers' default KV block
MAX_LINKS = 512  # links looked up at most (8,192 tokens): one MGET of at most this many keys


def chain(token_ids: list[int], routing_key: str = "", block: int = ROUTE_BLOCK) -> list[str]:
    """The digest of each leading full block of `token_ids`, each naming the whole prefix before it
    (at most MAX_LINKS, the first ones)."""
    digests = []
    last = hashlib.blake2b(routing_key.encode(), digest_size=12).digest()
    for start in range(0, min(len(token_ids) // block, MAX_LINKS) * block, block):
        last = hashlib.blake2b(last + array("I", token_ids[start:start + block]).tobytes(), digest_size=12).digest()
        digests.append(last.hex())
    return digests
