"""Structured output on the worker: a request's grammar (llguidance) as a mask on every pick.

The API compiles and checks a request's JSON schema, regex, choice or Lark grammar, and stores the
grammar's text once in Redis under its hash (keys.grammar, api/grammars.py); a job carries only the
hash. Here a worker fetches a grammar the first time a job names it, builds llguidance's matcher for
it on this model's tokenizer and keeps that pristine matcher by hash: each request then starts
from a copy of it (~15 µs) instead of a compile.

Per step, the model runner asks `MaskFiller` for the constrained rows' allowed tokens before the
forward pass and collects them after it: llguidance computes the masks on a thread of their own
with Python's lock released, while the C++ decoder computes the logits
(worker/continuous/model_runner.py); a few rows' (INLINE_ROWS) are computed right away instead.
The mask is as wide as the model's logits (tokens past the tokenizer's are never allowed), and
worker/logits.py applies it before every path that picks (greedy, torch's top-k/top-p, the C++
sampler). Each picked token is consumed by the matcher; once the grammar is complete and allows
nothing more, the sequence finishes with "stop".

Forced tokens (jump-forward, as SGLang calls it): after each pick the continuous engine asks
`Constraint.forced` whether the grammar now allows exactly one token (a key, punctuation, the rest
of an enum value). A step would pick that token whatever the logits say, so it is appended at once,
and the forced run is computed as one chunk in the next step instead of a step each
(worker/sequence.py `take_forced`). The mask computed to find out is the one the next step needs
when the token is not forced: it is kept, and MaskFiller does not compute it again.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional

import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np
import torch

log = logging.getLogger(__name__)

CACHED_GRAMMARS = 256  # pristine matchers kept per worker (a game uses a handful of schemas)
# Up to this many constrained rows, their masks are computed before the forward pass rather than
# beside it: a few rows' masks cost less than the thread's hand-off and the core it takes from the
# forward pass's threads on a 2-core machine (measured: docs/serving.md).
INLINE_ROWS = 4


class Constraint:
    """One request's matcher: which tokens may come next, and whether the grammar has ended."""

    def __init__(self, matcher: llguidance.LLMatcher, width: int):
        self.matcher = matcher
        self.width = width  # the model's logits: the mask's width
        self.mask: Optional[np.ndarray] = None  # the next token's mask [1, words], once forced() computed it

    def consume(self, token: int) -> None:
        self.mask = None
        if not self.matcher.consume_token(token):
            # The token came from this matcher's own mask, so this is a bug (or a replayed record
            # that does not fit the grammar): say so; the matcher's error then stops the sequence.
            log.warning("a token the grammar does not allow: %s", self.matcher.get_error())

    def forced(self) -> Optional[int]:
        """The one token the grammar allows next, or None where it allows more than one (or none).

        Exactly one bit in the mask, not llguidance's compute_ff_tokens: its fast-forward tokens
        are a tokenization of the forced bytes, which need not be the only token the mask allows,
        and it costs twice a mask (~90 against ~50 µs a call on SmolLM2's vocabulary)."""
        if self.mask is None:  # numpy's arrays, not torch's: this runs for every constrained row of every step
            self.mask = np.full(llguidance.numpy.get_bitmask_shape(1, self.width), -1, dtype=np.int32)
            llguidance.numpy.fill_next_token_bitmask(self.matcher, self.mask, 0)
        words = self.mask.view(np.uint32)[0]
        set_words = np.flatnonzero(words)
        if len(set_words) != 1:
            return None
        word = int(words[set_words[0]])
        if word & (word - 1):  # more than one bit in the word
            return None
        return int(set_words[0]) * 32 + word.bit_length() - 1

    @property
    def done(self) -> bool:
        """The grammar allows nothing more (complete and stopped, or broken)."""
        return self.matcher.is_stopped() or self.matcher.is_error()


class Grammars:
    """A worker's grammars: fetched by hash (`fetch`: the hash -> its text in Redis, or None),
    compiled once on this model's tokenizer, copied for each request."""

    def __init__(self, hf_tokenizer, vocab_width: int, fetch: Callable[[str], Optional[str]]):
        self._hf_tokenizer = hf_tokenizer
        self._width = vocab_width
        self._fetch = fetch
        self._tokenizer: Optional[llguidance.LLTokenizer] = None  # built by warm(), or at the first grammar
        self._matchers: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def warm(self) -> None:
        """Build llguidance's view of the tokenizer now (~0.3 s), not at the first grammar's request:
        the worker calls it on a thread at start."""
        with self._lock:
            self._llguidance_tokenizer()

    def _llguidance_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            self._tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self._width)
        return self._tokenizer

    def constraint(self, digest: str) -> Constraint:
        """A new request's constraint; ValueError if the grammar is gone or does not compile."""
        with self._lock:
            pristine = self._matchers.get(digest)
            if pristine is None:
                pristine = self._compile(digest)
                self._matchers[digest] = pristine
                while len(self._matchers) > CACHED_GRAMMARS:
                    self._matchers.popitem(last=False)
            self._matchers.move_to_end(digest)
            return Constraint(pristine.deep_copy(), self._width)

    def _compile(self, digest: str) -> llguidance.LLMatcher:
        text = self._fetch(digest)
        if text is None:
            raise ValueError(f"grammar {digest[:12]}... is not in Redis (expired, or the API that "
                             f"stored it used another Redis)")
        matcher = llguidance.LLMatcher(self._llguidance_tokenizer(), text)
        if matcher.is_error():
            raise ValueError(f"grammar {digest[:12]}... does not compile: {matcher.get_error()}")
        return matcher


class MaskFiller:
    """Computes the constrained rows' masks in the background while the step's forward pass runs
    (up to INLINE_ROWS of them at once, before it).

    One thread, row after row (llguidance's fill_next_token_bitmask, Python's lock released), done
    well inside a forward pass. Not llguidance's parallel executor: on 2 cores its threads, still
    spinning after their work, took a core from the forward pass's own (docs/serving.md).
    """

    def __init__(self):
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-masks")

    def start(self, constraints: list[Optional[Constraint]]) -> Optional[Future]:
        """A future of the [rows, words] bitmask for `constraints` (one per row that will get a token;
        None where unconstrained, whose words stay all ones), or None when no row is constrained."""
        if not any(c is not None for c in constraints):
            return None
        width = next(c.width for c in constraints if c is not None)
        bitmask = np.full(llguidance.numpy.get_bitmask_shape(len(constraints), width), -1, dtype=np.int32)
        rows = []
        for i, c in enumerate(constraints):
            if c is None:
                continue
            if c.mask is not None:  # computed already, looking for a forced token
                bitmask[i] = c.mask[0]
            else:
                rows.append((c.matcher, i))
        if len(rows) <= INLINE_ROWS:
            done = Future()
            done.set_result(_fill(rows, bitmask))
            return done
        return self._thread.submit(_fill, rows, bitmask)


def _fill(rows, bitmask: np.ndarray) -> torch.Tensor:
    for matcher, row in rows:
        llguidance.numpy.fill_next_token_bitmask(matcher, bitmask, row)
    return torch.from_numpy(bitmask)


def apply_mask(logits: torch.Tensor, bitmask: torch.Tensor, kernel=None) -> None:
    """-inf on the tokens the mask disallows, in place. On the CPU with the C++ kernels, their
    mask_rows (~0.2 ms at 64 rows); else llguidance's torch function, which torch.compile builds at
    its first call (seconds, once per process). Imported only here: importing it imports dynamo and
    torch.distributed (torch.compile), ~110 MiB a CPU worker would hold and never run."""
    if kernel is not None and hasattr(kernel, "mask_rows") and logits.device.type == "cpu":
        kernel.mask_rows(logits, bitmask)
    else:
        import llguidance.torch
        llguidance.torch.apply_token_bitmask_inplace(logits, bitmask)
