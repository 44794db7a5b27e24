"""One request inside an engine: its tokens, its text so far, and why it stopped. Both engines hold
these and the queue publishes from them; the continuous engine wraps each in a Request for its
cache and scheduler (docs/architecture.md, "Words that mean more than one thing")."""
from __future__ import annotations

import time
from bisect import bisect_left
from typing import Optional

import torch

from shared.protocol import Final, Job, TextDelta
from worker.logits import changes_logits
from worker.logprobs import split_offsets, text_offsets
from worker.sampling import new_generator

# Prompt tokens decoded in front of the first new token, so that tokenizers which drop a leading
# space at the start of a decode (SentencePiece) still produce the right first word.
_CONTEXT_TOKENS = 4


class Sequence:
    def __init__(self, job: Job, tokenizer, eos_ids: frozenset[int], written: Optional[list[int]] = None,
                 constraint=None):
        """`written`: the tokens an earlier attempt at the job wrote before its worker died (its
        record in Redis, checked by the engine): the sequence continues after them (`_resume`).
        `constraint`: its grammar's matcher (worker/constraint.py), which every token goes through,
        those of the record included, so a resumed job goes on constrained."""
        self.job = job
        self.params = job.params
        self.prompt_ids = list(job.prompt_ids)
        self.output_ids: list[int] = []
        self.generator = new_generator(job.params.seed)
        self.finish_reason: Optional[str] = None
        self.first_token_at = 0.0  # time.monotonic() of its first token: its time per output token
        self._tokenizer = tokenizer
        # The tokens that end it with "stop", left out of its text: end-of-text (unless ignore_eos)
        # and the request's stop_token_ids (masked until min_tokens: worker/logits.py).
        self.stop_ids = (frozenset() if job.params.ignore_eos else eos_ids) | frozenset(job.params.stop_token_ids)
        self.constraint = constraint
        self.adjusts = changes_logits(job.params)  # worker/logits.py has work on its logits
        # Log-probabilities (worker/logprobs.py): with params.logprobs an entry per written token,
        # [id, logprob, where its text starts in `text`, top k], kept aligned with the text; with
        # params.prompt_logprobs the runner's (logprob, top k) of each prompt token after the first,
        # by the position that scores it (prompt_scores[p] scores prompt token p + 1).
        self.logprobs: Optional[list] = [] if job.params.logprobs is not None else None
        self.prompt_scores: Optional[list] = (
            [None] * (len(self.prompt_ids) - 1) if job.params.prompt_logprobs is not None else None)
        self._logprobs_sent = 0  # leading entries of `logprobs` published
        self._prompt_logprobs_sent = False
        self._prompt_offsets: Optional[list[int]] = None
        self.cached_tokens = 0  # prompt tokens the prefix cache held at its admission (the scheduler's)
        # Text is needed token by token only to stream it, to watch for stop strings or to place each
        # token's logprobs in it; otherwise it is decoded once, at the end (a decode per token per
        # row is a real cost at batch 64).
        self._incremental = job.stream or bool(job.params.stop) or self.logprobs is not None
        # Incremental detokenization: decode a short window, keep only what is new and complete.
        self._window = self.prompt_ids[-_CONTEXT_TOKENS:]
        self._prefix_offset = 0
        self._read_offset = len(self._window)
        self.text = ""  # all text written so far (cut at a stop string)
        self._sent = 0  # how much of `text` has been published
        self.resumed = 0  # leading output tokens taken from an earlier attempt's record
        self.recorded = 0  # leading output tokens in the job's record in Redis (the queue keeps it)
        if written:
            self._resume(written)

    @property
    def id(self) -> str:
        return self.job.id

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token: int, entry=None) -> None:
        """Take the next token, then decide whether the sequence is finished. `entry`: its
        (logprob, top k) where the request asks for logprobs (worker/logprobs.py); a token that ends
        the reply (end-of-text, stop_token_ids) is not in the text and gets no entry, as OpenAI's."""
        if token in self.stop_ids:
            self._finish("stop")
            return
        if not self.first_token_at:
            self.first_token_at = time.monotonic()
        self.output_ids.append(token)
        if self.constraint is not None:
            self.constraint.consume(token)
        if self._incremental:
            if self.logprobs is not None:  # its text starts where the text ends, or later (_take_text)
                logprob, top = entry if entry is not None else (None, [])
                self.logprobs.append([token, logprob, len(self.text), top])
            self._window.append(token)
            self._take_text()
            if self._cut_at_stop_string():
                self.finish_reason = "stop"  # the text ends where the stop string began
                return
        if self.constraint is not None and self.constraint.done:  # the grammar is complete
            self._finish("stop")
        elif len(self.output_ids) >= self.params.max_tokens:
            self._finish("length")

    def take_forced(self):
        """Append the tokens the grammar forces from here, each as a step would have picked it
        (worker/constraint.py `forced`), and yield them. A sampled request draws from its generator
        for each, as its step would have (worker/sampling.py), so what follows is drawn as step by
        step and a resume replays them as any other token. Not where logprobs are asked: those come
        from the logits of a step."""
        while self.constraint is not None and self.logprobs is None and not self.finished:
            token = self.constraint.forced()
            if token is None or token in self.stop_ids:  # an end is left to the step's own rules (min_tokens)
                return
            if not self.params.greedy:
                torch.rand((), generator=self.generator)
            self.append(token)
            yield token

    def _resume(self, written: list[int]) -> None:
        """Continue where an earlier attempt stopped: each of its tokens is taken as it took it, so
        the text, the detokenizer's window and the stop-string check are what that attempt had, and
        for a sampled job the generator makes the draws it made (one per token: worker/sampling.py),
        so the next token is drawn as it would have been. Nothing is published here: the first
        delta starts at offset 0, and the API sends its client only what it has not had."""
        for token in written:
            if self.finished:  # the record alone completes it (a stop string, max_tokens)
                break
            self.append(token)
            if not self.params.greedy:
                torch.rand((), generator=self.generator)
        self.resumed = self.recorded = len(self.output_ids)
        self.first_token_at = 0.0  # its time per output token counts the tokens written here

    def cancel(self, reason: str = "cancelled") -> None:
        self.finish_reason = reason

    def _finish(self, reason: str) -> None:
        self.finish_reason = reason
        if self._incremental:  # what was held back as half a character is all there will be
            self._take_text(final=True)
        else:  # decoded after the same prompt context as the incremental path, so both agree
            context = self.prompt_ids[-_CONTEXT_TOKENS:]
            self.text = self._decode(context + self.output_ids)[len(self._decode(context)):]

    def delta(self) -> Optional[TextDelta]:
        """Text not published yet, holding back a tail that may be the start of a stop string.

        Call `sent(delta)` once it is published; until then the same text comes again.
        """
        end = len(self.text) if self.finished else len(self.text) - self._stop_prefix_len()
        if end <= self._sent:
            return None
        delta = TextDelta(text=self.text[self._sent:end], offset=self._sent,
                          completion_tokens=len(self.output_ids))
        if self.logprobs is not None:
            # The entries of the tokens whose text starts in this delta's: a token whose text is
            # held back (half a character, maybe a stop string) waits with it; all, once finished.
            last = len(self.logprobs) if self.finished else bisect_left(self.logprobs, end, key=_text_offset)
            delta.logprobs, delta.logprobs_start = self.logprobs[self._logprobs_sent:last], self._logprobs_sent
        if self.prompt_scores is not None and not self._prompt_logprobs_sent:
            delta.prompt_logprobs = self.prompt_logprobs()  # a stream's echo sends them first
        return delta

    def sent(self, delta: TextDelta) -> None:
        self._sent = max(self._sent, delta.offset + len(delta.text))
        if delta.logprobs is not None:
            self._logprobs_sent = max(self._logprobs_sent, delta.logprobs_start + len(delta.logprobs))
        if delta.prompt_logprobs is not None:
            self._prompt_logprobs_sent = True

    def final(self) -> Final:
        return Final(text=self.text, finish_reason=self.finish_reason,
                     prompt_tokens=len(self.prompt_ids), completion_tokens=len(self.output_ids),
                     logprobs=self.logprobs, prompt_logprobs=self.prompt_logprobs(),
                     cached_tokens=self.cached_tokens)

    def prompt_logprobs(self) -> Optional[list]:
        """The prompt's entries (with params.prompt_logprobs), in the written tokens' form, text
        offsets in the prompt's own text; the first token's logprob and top are None (nothing
        scores it), as OpenAI's token_logprobs[0]."""
        if self.prompt_scores is None:
            return None
        if self._prompt_offsets is None:  # the prompt's text does not change: decoded once
            self._prompt_offsets = text_offsets(self._decode, self.prompt_ids)
        offsets = self._prompt_offsets
        scores = [(None, None)] + [s if s is not None else (None, []) for s in self.prompt_scores]
        return [[token, logprob, offset, top]
                for token, offset, (logprob, top) in zip(self.prompt_ids, offsets, scores)]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def _decode_new(self, final: bool = False) -> str:
        before = self._decode(self._window[self._prefix_offset:self._read_offset])
        after = self._decode(self._window[self._prefix_offset:])
        # A token that ends inside a multi-byte character decodes to U+FFFD: wait for the rest.
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._window)
        return after[len(before):]

    def _take_text(self, final: bool = False) -> None:
        """The text of the window's new tokens, once whole; with logprobs, the tokens whose text
        came out together (a character split over tokens held them back) get their own offsets."""
        prefix, read = self._prefix_offset, self._read_offset
        new = self._decode_new(final)
        if new and self.logprobs is not None and len(self._window) - read > 1:
            starts = split_offsets(self._decode, self._window[prefix:], read - prefix, len(self.text), new)
            for entry, start in zip(self.logprobs[-len(starts):], starts):
                entry[2] = start
        self.text += new

    def _cut_at_stop_string(self) -> bool:
        found = [i for i in (self.text.find(s) for s in self.params.stop) if i >= 0]
        if found:
            self.text = self.text[:min(found)]
            if self.logprobs is not None:  # the tokens whose text starts at or past the cut go too
                del self.logprobs[bisect_left(self.logprobs, len(self.text), key=_text_offset):]
        return bool(found)

    def _stop_prefix_len(self) -> int:
        """Length of the longest tail of `text` that could still grow into a stop string."""
        longest = 0
        for stop in self.params.stop:
            for n in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if stop.startswith(self.text[-n:]):
                    longest = n
                    break
        return longest


def _text_offset(entry: list) -> int:
    return entry[2]
