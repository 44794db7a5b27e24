"""Log-probabilities and echo in OpenAI's answer shapes, from the workers' entries.

A worker sends, per token, [token id, logprob, text offset, [[id, logprob], ...the k likeliest]]
(shared/protocol.py), from the model's own log-softmax before temperature, penalties and masks
(vLLM's default, "raw_logprobs"). Here they become, for completions, OpenAI's
    {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob}...], "text_offset": [...]}
(with echo, the prompt's entries first: its first token's logprob and top are null, and the reply's
offsets count after the prompt's text), and for chat
    {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}], "refusal": null}.
A token's `token` is its text; one that is only part of a character (byte-level tokens) is written
as OpenAI writes it, "bytes:\\xe2\\x80", its exact bytes being in `bytes`.
"""
from __future__ import annotations

from typing import Optional

from shared.protocol import Final


def token_text(piece: bytes) -> str:
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in piece)


class Rendering:
    """One request's logprobs (and completions' echo): `chat` picks the route's shape; `asked`,
    whether it asked for logprobs; `echo`, each choice's prompt text to write before its answer
    (completions' echo: the prompt as given, or its ids decoded), or None."""

    def __init__(self, tokenizer, chat: bool, asked: bool, echo: Optional[list[str]] = None):
        self._tokenizer = tokenizer
        self.chat = chat
        self.asked = asked
        self.echo = echo

    def text(self, index: int, text: str) -> str:
        """A choice's whole text: with echo, its prompt's first."""
        return self.echo[index] + text if self.echo else text

    def whole(self, index: int, final: Final) -> Optional[dict]:
        """A whole answer's choices[index].logprobs (None where not asked)."""
        if not self.asked:
            return None
        entries = final.logprobs or []
        if self.echo and final.prompt_logprobs is not None:
            return self._completion(final.prompt_logprobs + self._shifted(index, entries))
        return self.piece(index, entries)

    def piece(self, index: int, entries: list) -> Optional[dict]:
        """The logprobs of a streamed piece of the answer (its tokens' entries), or of a whole one."""
        if not self.asked:
            return None
        if self.chat:
            return {"content": self._chat(entries), "refusal": None}
        return self._completion(self._shifted(index, entries))

    def echo_piece(self, index: int, prompt_entries: Optional[list]) -> Optional[dict]:
        """The logprobs of a stream's echoed prompt (None where not asked, or none came)."""
        if not self.asked or prompt_entries is None:
            return None
        return self._completion(prompt_entries)

    def _shifted(self, index: int, entries: list) -> list:
        """Entries with their text offsets counted in the choice's whole text (after an echo)."""
        shift = len(self.echo[index]) if self.echo else 0
        return [[t, lp, offset + shift, top] for t, lp, offset, top in entries] if shift else entries

    def _pieces(self, entries: list) -> dict[int, bytes]:
        """Each id's bytes, for every token the entries name (chosen or among the likeliest)."""
        ids = sorted({e[0] for e in entries} | {i for e in entries for i, _ in (e[3] or ())})
        return dict(zip(ids, self._tokenizer.token_bytes(ids))) if ids else {}

    def _completion(self, entries: list) -> dict:
        pieces = self._pieces(entries)
        return {"tokens": [token_text(pieces[e[0]]) for e in entries],
                "token_logprobs": [e[1] for e in entries],
                "top_logprobs": [None if e[3] is None else {token_text(pieces[i]): lp for i, lp in e[3]}
                                 for e in entries],
                "text_offset": [e[2] for e in entries]}

    def _chat(self, entries: list) -> list[dict]:
        pieces = self._pieces(entries)

        def one(token_id: int, logprob: float) -> dict:
            piece = pieces[token_id]
            return {"token": token_text(piece), "logprob": logprob, "bytes": list(piece)}
        return [{**one(e[0], e[1]), "top_logprobs": [one(i, lp) for i, lp in e[3] or ()]} for e in entries]


class StreamState:
    """What of each choice's logprobs a stream has sent: entries are skipped by their index among
    the answer's tokens (a job written again after its worker died repeats them, as its text),
    and each piece's wait for the next chunk of their choice (a chat with tools may hold text back)."""

    def __init__(self, choices: int):
        self._sent = [0] * choices
        self.waiting: list[list] = [[] for _ in range(choices)]
        self.echoed = [False] * choices

    def take(self, index: int, entries: Optional[list], start: int) -> None:
        """A result's entries (`start`: the first one's index); those not sent yet wait."""
        if entries is None or start > self._sent[index]:
            return  # none, or a message was missed: the final answer carries them all
        new = entries[self._sent[index] - start:]
        self._sent[index] += len(new)
        self.waiting[index] += new

    def flush(self, index: int) -> list:
        entries, self.waiting[index] = self.waiting[index], []
        return entries
