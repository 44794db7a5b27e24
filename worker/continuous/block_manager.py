"""The paged KV cache's bookkeeping: which block holds which tokens, who shares it, what can go.

The cache is a fixed pool of blocks of `block_size` token slots. A request holds a block table
(its blocks in order); its token at position p lives in slot `table[p // size] * size + p % size`.

Prefix caching: once a block is full and computed, it is named by a hash of its tokens chained
over every block before it, so two prompts that start alike find the same blocks and share them
(reference counts). A block nobody holds any more keeps its KV and its name, on a list of
evictable blocks, oldest first; it is reused by a later match, or taken for new tokens only when
the never-named free blocks have run out.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class BlockTable:
    """A request's share of the cache."""
    blocks: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # chain hashes of the leading full, computed blocks


def chain_hash(previous: Optional[int], tokens: tuple[int, ...]) -> int:
    return hash((previous, tokens))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("the KV cache needs at least one block of at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._refs = [0] * num_blocks
        self._name: list[Optional[tuple[int, tuple[int, ...]]]] = [None] * num_blocks  # (hash, tokens)
        # Unnamed and unheld; taken last-freed first, so a worker touches only as much of the
        # pool's memory as it has ever needed at once (a queue would walk through all of it).
        self._fresh = list(range(num_blocks - 1, -1, -1))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # named, unheld; oldest first
        self._by_hash: dict[int, int] = {}  # hash -> block
        self.hits = 0  # prompt tokens found in the cache, since start (for the heartbeat)

    @property
    def free(self) -> int:
        return len(self._fresh) + len(self._evictable)

    def usage(self) -> float:
        return 1 - self.free / self.num_blocks

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def allocate(self, table: BlockTable, tokens: list[int], margin: int = 0,
                 cached: bool = True) -> Optional[int]:
        """Blocks for all of `tokens` (a request being admitted), reusing cached ones (unless not
        `cached`: a request that needs every position computed, for its prompt logprobs).

        Returns how many leading tokens are already in the cache, or None (nothing taken) when
        fewer than the needed blocks plus `margin` are free.
        """
        assert not table.blocks, "allocate is for a request that holds nothing"
        matched = self._match(tokens) if cached else []
        reused_free = sum(1 for b in matched if self._refs[b] == 0)
        needed = self.blocks_for(len(tokens)) - len(matched)
        if self.free - reused_free < needed + margin:
            return None
        for block in matched:
            self._hold(block)
        table.blocks = matched + [self._take() for _ in range(needed)]
        table.hashes = [self._name[b][0] for b in matched]
        self.hits += len(matched) * self.block_size
        return len(matched) * self.block_size

    def cached(self, tokens: list[int]) -> int:
        """How many leading tokens of `tokens` the cache holds now: what allocate() would reuse."""
        return len(self._match(tokens)) * self.block_size

    def grow(self, table: BlockTable, tokens: int) -> bool:
        """Make room for `tokens` tokens in all; False (nothing taken) if the pool is out of blocks."""
        needed = self.blocks_for(tokens) - len(table.blocks)
        if needed > self.free:
            return False
        table.blocks += [self._take() for _ in range(needed)]
        return True

    def computed(self, table: BlockTable, tokens: list[int], count: int) -> None:
        """The first `count` of `tokens` now have their KV in the cache: name the full blocks."""
        if not self.prefix_caching:
            return
        size = self.block_size
        for i in range(len(table.hashes), count // size):
            chunk = tuple(tokens[i * size:(i + 1) * size])
            h = chain_hash(table.hashes[-1] if table.hashes else None, chunk)
            table.hashes.append(h)
            block = table.blocks[i]
            if h not in self._by_hash and self._name[block] is None:
                self._name[block] = (h, chunk)
                self._by_hash[h] = block

    def release(self, table: BlockTable) -> None:
        """Give the blocks back; named ones stay matchable until they are needed."""
        # Last block first: when evicted oldest first, a prefix's tail goes before its head.
        for block in reversed(table.blocks):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if self._name[block] is None:
                    self._fresh.append(block)
                else:
                    self._evictable[block] = None
        table.blocks, table.hashes = [], []

    def _match(self, tokens: list[int]) -> list[int]:
        """The cached blocks that hold a prefix of `tokens`; the last token is always left to
        compute, since its logits are what the request needs next."""
        if not self.prefix_caching:
            return []
        size, matched, previous = self.block_size, [], None
        for i in range((len(tokens) - 1) // size):
            chunk = tuple(tokens[i * size:(i + 1) * size])
            previous = chain_hash(previous, chunk)
            block = self._by_hash.get(previous)
            if block is None or self._name[block][1] != chunk:  # a hash collision is not a match
                break
            matched.append(block)
        return matched

    def _hold(self, block: int) -> None:
        if self._refs[block] == 0:
            self._evictable.pop(block, None)
        self._refs[block] += 1

    def _take(self) -> int:
        if self._fresh:
            block = self._fresh.pop()
        else:
            block, _ = self._evictable.popitem(last=False)  # the longest unused
            h, _ = self._name[block]
            del self._by_hash[h]
            self._name[block] = None
        self._refs[block] = 1
        return block
