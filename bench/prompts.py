"""What the benchmark's players ask for: prompts of a chosen length and answers of a chosen size.

A prompt is filler lore (sentences about the game's world) followed by the player's request, so
the model sees something story-like whatever the length; with EOS honoured, a story-shaped
prompt gets story-shaped answers that end on their own, as real players' would.

Lengths are in *approximate* tokens: we count words and scale by TOKENS_PER_WORD rather than load
a tokenizer, so the benchmark stays usable against any server. The server's own count comes back
in usage.prompt_tokens, and the benchmark reports that, not our estimate.
"""
from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from typing import Optional

WORDS = ("sword", "gate", "skeleton", "dragon", "castle", "forest", "potion", "wizard",
         "goblin", "treasure", "map", "tavern", "knight", "shield", "dungeon", "elf",
         "troll", "scroll", "amulet", "bow", "ghost", "river", "tower", "crown")

# Words of the lore sentences. Short common words, so a word is about one token or a little more.
ADJECTIVES = ("old", "silent", "broken", "golden", "hidden", "cursed", "ancient", "frozen",
              "burning", "forgotten", "hollow", "crimson", "quiet", "bitter", "distant")
PLACES = ("north", "marsh", "valley", "harbour", "mountain", "city", "desert", "island",
          "border", "mine", "temple", "road", "field", "bridge", "well")
VERBS = ("guards", "remembers", "hides", "watches", "seeks", "carries", "breaks", "sings to",
         "fears", "follows", "waits for", "sells", "keeps", "finds", "loses")

# SmolLM2's tokenizer writes these lore sentences as ~1.18 tokens per word (measured on 20,000
# words of make_lore output): a prompt asked to be N tokens comes out within a few % of N
# (1,500 -> ~1,480; 300 -> ~295; the shared 300-token system text -> ~300).
TOKENS_PER_WORD = 1.18

# The shared system prompt must be the same text for every request and every run (that is what
# a prefix cache can reuse), so it comes from its own fixed generator, not the players' seeds.
SYSTEM_SEED = 20261129
SYSTEM_HEADER = "You are the storyteller of a fantasy world. Here is its lore.\n"
SYSTEM_FOOTER = "\nStay true to the lore.\n\n"


def article(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def make_prompt(rng: random.Random) -> str:
    """The classic short request: a story about three things (three rng draws, as always)."""
    words = [article(w) for w in rng.sample(WORDS, 3)]
    return f"Write a short story about {words[0]}, {words[1]} and {words[2]}.\n"


def lore_sentence(rng: random.Random) -> str:
    return (f"The {rng.choice(ADJECTIVES)} {rng.choice(WORDS)} of the {rng.choice(PLACES)} "
            f"{rng.choice(VERBS)} the {rng.choice(ADJECTIVES)} {rng.choice(WORDS)}.")


def make_lore(rng: random.Random, words: int) -> str:
    """Exactly `words` whitespace-separated words of lore (the last sentence may be cut short)."""
    out: list[str] = []
    while len(out) < words:
        out += lore_sentence(rng).split()
    return " ".join(out[:words])


def words_for_tokens(tokens: int) -> int:
    return max(0, round(tokens / TOKENS_PER_WORD))


def approx_tokens(text: str) -> int:
    """Our estimate of the tokens in `text` (the inverse of words_for_tokens)."""
    return round(len(text.split()) * TOKENS_PER_WORD)


@functools.lru_cache(maxsize=8)
def system_prompt(tokens: int) -> str:
    """The same ~`tokens`-token lore text on every call: the shared prefix of every request."""
    if tokens <= 0:
        return ""
    frame = approx_tokens(SYSTEM_HEADER + SYSTEM_FOOTER)
    body = make_lore(random.Random(SYSTEM_SEED), words_for_tokens(max(0, tokens - frame)))
    return SYSTEM_HEADER + body + SYSTEM_FOOTER


def sized_prompt(rng: random.Random, tokens: int) -> str:
    """A ~`tokens`-token prompt: lore filler, then the classic request (which counts too)."""
    request = make_prompt(rng)
    filler = words_for_tokens(tokens - approx_tokens(request))
    return (make_lore(rng, filler) + "\n" if filler else "") + request


@dataclass(frozen=True)
class RequestShape:
    """How each request of a crowd is drawn.

    prompt_tokens: None for the classic short prompt, or (min, max) approximate tokens;
    max_tokens: (min, max) of max_tokens, the same number twice for a fixed size;
    system_tokens: length of the shared system text every prompt starts with (0: none).
    """
    max_tokens: tuple[int, int] = (100, 100)
    prompt_tokens: Optional[tuple[int, int]] = None
    system_tokens: int = 0

    def __post_init__(self):
        for name in ("max_tokens", "prompt_tokens"):
            span = getattr(self, name)
            if span is not None and not (0 < span[0] <= span[1]):
                raise ValueError(f"{name} must be 0 < MIN <= MAX, got {span}")
        if self.system_tokens < 0:
            raise ValueError("system_tokens must be >= 0")

    @classmethod
    def fixed(cls, tokens: int) -> "RequestShape":
        return cls(max_tokens=(tokens, tokens))

    def draw(self, rng: random.Random) -> tuple[str, int]:
        """One request's (prompt, max_tokens). With the defaults this draws from `rng` exactly as
        the original benchmark did, so old seeds give the same prompts."""
        if self.prompt_tokens is None:
            prompt = make_prompt(rng)
        else:
            prompt = sized_prompt(rng, rng.randint(*self.prompt_tokens))
        low, high = self.max_tokens
        tokens = low if low == high else rng.randint(low, high)
        return system_prompt(self.system_tokens) + prompt, tokens

    def describe(self) -> str:
        low, high = self.max_tokens
        parts = [f"max_tokens {low}" if low == high else f"max_tokens {low}-{high}"]
        if self.prompt_tokens:
            parts.append("prompts ~{}-{} tokens".format(*self.prompt_tokens))
        if self.system_tokens:
            parts.append(f"shared system prompt ~{self.system_tokens} tokens")
        return ", ".join(parts)
