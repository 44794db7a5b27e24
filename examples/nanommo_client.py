"""A nanoMMO game server's side of Storyteller: several players at once, each asking the world's
storyteller what happens next and reading the story as it is written.

    ./serve.sh                                   # in another terminal
    python examples/nanommo_client.py --url http://127.0.0.1:8000/v1 --players 8

Only the official `openai` client. What a game server needs from it, shown here:
- timeouts: a storyteller that went quiet must not hold a player forever;
- retries with backoff on 429 (the queue is full) and 503 (no worker, e.g. during a restart),
  waiting what the server's Retry-After says, and only before any text reached the player (a
  story cut halfway is not started again, which would tell its beginning twice);
- streaming: the player reads each piece as soon as it is written (here, with many players at
  once, the terminal shows one log line per finished story, as a game server's log would);
- priority: a boss fight's narration (--priority -5) goes ahead of background lore;
- errors a person can act on: a wrong API key, a full queue or no service ends in one line that
  says so (exit status 1), not a traceback.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import openai

WORLD = "You narrate a small fantasy world. Answer in two or three vivid sentences."
PLAYERS = ["Aria", "Borin", "Cael", "Dara", "Eryk", "Fenna", "Gorm", "Hild", "Ivo", "Juna", "Kestrel", "Lune"]
ACTIONS = ["I push open the gate of the ruined keep.", "I offer the dragon a potion.",
           "I read the spell from the old book aloud.", "I follow the skeleton into the forest.",
           "I ask the innkeeper about the missing gold.", "I climb the tower at midnight."]
RETRYABLE = (429, 503)


class Narrator:
    """The game server's log: one whole line per event (a story told, a retry, a failure), each
    with the time and the player, so several players' streams never interleave mid-line."""

    def __init__(self, out=sys.stdout):
        self.out, self.lock = out, threading.Lock()

    def log(self, player: str, text: str) -> None:
        with self.lock:
            self.out.write(f"{time.strftime('%H:%M:%S')} {'[' + player + ']':<10} {text}\n")
            self.out.flush()


def first_words(text: str, width: int = 60) -> str:
    """The story's opening, on one line: what a log shows of it."""
    return textwrap.shorten(" ".join(text.split()), width, placeholder=" ...") or "(no text)"


def server_says(exc: openai.APIStatusError) -> str:
    """The server's own message (the error's `message`), without the client's "Error code: ..." prefix."""
    body = exc.body if isinstance(exc.body, dict) else {}
    return str(body.get("message") or exc.message)


def explain(exc: Exception, url: str) -> str:
    """One line a person can act on, for the errors a new user meets first; others as they are."""
    if isinstance(exc, openai.AuthenticationError):
        return (f"the server refused the API key (401: {server_says(exc)}); "
                f"pass the right one with --api-key or OPENAI_API_KEY")
    if isinstance(exc, openai.RateLimitError):
        return f"the server is too busy (429: {server_says(exc)}); try fewer --players, or again later"
    if isinstance(exc, openai.APITimeoutError):
        return f"no answer from {url} within --timeout"
    if isinstance(exc, openai.APIConnectionError):
        return f"no service at {url} ({exc.__cause__ or exc}); is ./serve.sh running?"
    if isinstance(exc, openai.APIStatusError):
        return f"the server answered {exc.status_code}: {server_says(exc)}"
    return f"{type(exc).__name__}: {exc}"


@dataclass
class Played:
    player: str
    first_text_s: list[float] = field(default_factory=list)  # per turn: request sent -> first text
    story_s: list[float] = field(default_factory=list)
    retries: int = 0
    failure: str = ""


def retry_after(exc: Exception):
    """Seconds the server asked us to wait (Retry-After), or None."""
    response = getattr(exc, "response", None)
    value = response.headers.get("retry-after") if response is not None else None
    try:
        return float(value) if value else None
    except ValueError:
        return None


def tell(client: openai.OpenAI, args, player: str, messages: list, narrator: Narrator, played: Played,
         seed=None) -> str:
    """One turn: stream the storyteller's answer to `player`, retrying while nothing was shown yet."""
    for attempt in range(args.retries + 1):
        began, shown = time.monotonic(), []
        try:
            stream = client.chat.completions.create(
                model=args.model, messages=messages, max_tokens=args.max_tokens, stream=True,
                stream_options={"include_usage": True}, seed=seed, extra_body={"priority": args.priority})
            tokens = None
            for chunk in stream:
                if chunk.usage is not None:  # the last chunk, asked for by include_usage
                    tokens = chunk.usage.completion_tokens
                text = chunk.choices[0].delta.content if chunk.choices else None
                if text:
                    if not shown:
                        played.first_text_s.append(time.monotonic() - began)
                    shown.append(text)  # a game would show it to its player now
            took = time.monotonic() - began
            played.story_s.append(took)
            story = "".join(shown)
            narrator.log(player, f"story {len(played.story_s)}: {tokens if tokens is not None else '?'} tokens "
                                 f"in {took:.2f} s: {first_words(story)}")
            return story
        except (openai.APIStatusError, openai.APIConnectionError) as exc:
            status = getattr(exc, "status_code", None)
            retryable = status in RETRYABLE or isinstance(exc, openai.APIConnectionError)
            if shown or not retryable or attempt == args.retries:
                raise
            wait = retry_after(exc)
            if wait is None:  # exponential backoff with jitter, so retrying players spread out
                wait = min(30.0, 0.5 * 2 ** attempt) * random.uniform(0.5, 1.0)
            played.retries += 1
            narrator.log(player, f"the storyteller is busy ({status or 'no answer'}); again in {wait:.1f} s")
            time.sleep(wait)
    raise AssertionError("unreachable")


def play(client: openai.OpenAI, args, player: str, narrator: Narrator, number: int = 0) -> Played:
    """`player`'s turns, one story each. With --seed, the player's stories are drawn from seeds of
    their own (the seed plus their number and turn), so two players asking alike are told apart."""
    played = Played(player)
    messages = [{"role": "system", "content": WORLD}]
    actions = random.Random(player).sample(ACTIONS, len(ACTIONS))
    try:
        for turn in range(args.turns):
            messages.append({"role": "user", "content": actions[turn % len(actions)]})
            seed = None if args.seed is None else args.seed + 1000 * number + turn
            story = tell(client, args, player, messages, narrator, played, seed)
            messages.append({"role": "assistant", "content": story})
    except openai.APIError as exc:  # also an error the server sent in the middle of a stream
        played.failure = explain(exc, args.url)
        narrator.log(player, f"the story broke off: {played.failure}")
    return played


class Help(argparse.ArgumentDefaultsHelpFormatter):
    """--help with every default, except the unset ones, whose help says what happens instead."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=Help)
    parser.add_argument("--url", default="http://127.0.0.1:8000/v1", help="the API's base URL")
    # The key's value stays out of --help (the default shown is where it comes from).
    parser.add_argument("--api-key", default=None,
                        help="an API key, if the server wants one (default: env OPENAI_API_KEY)")
    parser.add_argument("--model", help="the model (default: the first one served)")
    parser.add_argument("--players", type=int, default=8, help="players asking at once")
    parser.add_argument("--turns", type=int, default=2, help="stories per player, each following the last")
    parser.add_argument("--max-tokens", type=int, default=80, help="tokens per story, at most")
    parser.add_argument("--priority", type=int, default=0, help="-10 (most urgent) to 10")
    parser.add_argument("--timeout", type=float, default=60, help="seconds a request may take, at most")
    parser.add_argument("--retries", type=int, default=5, help="tries again on 429/503/no answer")
    parser.add_argument("--seed", type=int, default=None,
                        help="reproducible stories: each player's turns are drawn from seeds of their own, "
                             "from this one; the same players, turns and seed tell the same stories "
                             "(default: a fresh draw each time)")
    args = parser.parse_args(argv)
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY") or "unused"
    client = openai.OpenAI(base_url=args.url, api_key=api_key, timeout=args.timeout, max_retries=0)
    if not args.model:
        try:
            served = client.models.list().data
        except openai.APIError as exc:
            print(f"error: {explain(exc, args.url)}", file=sys.stderr)
            return 1
        if not served:
            print(f"error: {args.url} serves no model yet (is a worker running?)", file=sys.stderr)
            return 1
        args.model = served[0].id
    narrator = Narrator()
    names = [PLAYERS[i % len(PLAYERS)] + (str(i // len(PLAYERS) + 1) if i >= len(PLAYERS) else "")
             for i in range(args.players)]
    with ThreadPoolExecutor(args.players) as pool:
        results = list(pool.map(lambda number: play(client, args, names[number], narrator, number),
                                range(len(names))))
    firsts = [t for r in results for t in r.first_text_s]
    failed = [r for r in results if r.failure]
    # No timing when no text ever came: a median of nothing says nothing.
    timing = f"first text after {statistics.median(firsts):.2f} s (median), " if firsts else ""
    print(f"{args.players} players, {sum(len(r.story_s) for r in results)} stories from {args.model}; "
          f"{timing}{sum(r.retries for r in results)} retries, {len(failed)} players failed")
    # One line per distinct reason: eight players refused the same key is one error, not eight.
    reasons: dict[str, list[str]] = {}
    for r in failed:
        reasons.setdefault(r.failure, []).append(r.player)
    for reason, players in reasons.items():
        print(f"error ({', '.join(players)}): {reason}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
