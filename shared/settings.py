"""All settings, in one dataclass, read from the environment and then from command-line flags.

Each field's environment variable is its name in capitals (`redis_url` -> REDIS_URL) and its flag is
its name with dashes (`--redis-url`), unless the field says otherwise. Flags win over the environment,
which wins over the defaults; the defaults run everything on one machine.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field, fields, replace
from typing import Optional, Sequence

from shared.redis_client import as_cluster, masked


def _setting(default, help: str, flag: Optional[str] = None, env: Optional[str] = None, secret: bool = False):
    # A secret is never shown: not in --help, not in repr, not in an error message.
    return field(default=default, metadata={"help": help, "flag": flag, "env": env, "secret": secret})


@dataclass(frozen=True)
class Settings:
    redis_url: str = _setting("redis://127.0.0.1:6379/0", "Redis that carries jobs and results "
                                                          "(redis+sentinel://, redis+cluster://, "
                                                          "rediss:// for TLS)")
    redis_cluster: bool = _setting(False, "REDIS_URL is a node of a Redis Cluster (as a "
                                          "redis+cluster:// URL says)")

    # The API
    host: str = _setting("127.0.0.1", "address the API listens on (0.0.0.0 in a container)")
    port: int = _setting(8000, "port the API listens on")
    api_worker_class: str = _setting("gevent", "gevent (a greenlet per waiting player: thousands per "
                                               "process) | gthread (a thread per waiting player, "
                                               "--threads of them)")
    api_connections: int = _setting(4096, "players one API process holds at once with gevent (more "
                                          "wait in the listen backlog)")
    threads: int = _setting(256, "threads per API process with gthread: one per waiting player")
    api_workers: int = _setting(1, "API processes under gunicorn")
    redis_connections: int = _setting(32, "Redis connections one API process opens at most, its "
                                          "pub/sub subscriber's included; past them a request "
                                          "waits for a free one")
    request_timeout: float = _setting(300.0, "seconds a request may wait for its answer")
    max_queue: int = _setting(-1, "jobs that may wait per model before new requests get 429 with "
                                  "Retry-After (-1: "
                                  "4x what the live workers hold at once; 0: unbounded)")
    affinity_wait: float = _setting(0.05, "seconds at least a conversation's next turn is offered to the worker "
                                          "that answered its last one (its prefix cache holds the history) before "
                                          "an idle worker may take it (a busy one once that worker's heartbeat is "
                                          "late); longer where that worker's steps are (two of "
                                          "them, up to 2 s) (0: no routing; docs/scaling.md says how the "
                                          "default was measured)")
    worker_grace: float = _setting(60.0, "seconds a request whose jobs are queued waits for a worker "
                                         "to come back (a restart) before it gives up with 503")
    api_keys: str = _setting("", "comma-separated API keys; set, every /v1 request needs "
                                 "'Authorization: Bearer <key>' (empty: no auth)", secret=True)
    api_keys_file: str = _setting("", "a file of API keys, one per line, blank lines and # comments "
                                      "skipped (with or instead of --api-keys)")
    rate_limit: int = _setting(0, "requests per minute per API key (per client address without keys), "
                                  "across API processes (0: no limit)")
    lenient: bool = _setting(False, "log and ignore request fields this API does not know, instead of a 400 "
                                    "(for clients that send extras)")
    open_objects: bool = _setting(False, "JSON schemas' objects take properties they do not declare (JSON "
                                         "Schema's own reading); off: an object that declares its properties "
                                         "is closed unless it says additionalProperties, as xgrammar and "
                                         "Outlines read it (docs/structured-output.md)")
    # The batch API
    files_dir: str = _setting("", "directory for uploaded and batch output files, shared by the API and "
                                  "the batch worker (empty: in Redis)")
    batch_file_limit: int = _setting(100, "MiB an uploaded batch file may hold at most (beyond: 413 "
                                          "file_too_large)")
    batch_concurrency: int = _setting(8, "requests of one batch in flight at once (batch worker); they go "
                                         "at the lowest priority, so live players go first")
    api_url: str = _setting("http://127.0.0.1:8000/v1", "the API the batch worker sends a batch's "
                                                          "requests to (serve.sh sets its own)")

    # The worker
    model: str = _setting("smollm2", "'smollm2' (the packaged SmolLM2-135M-Instruct), a GGUF file (or "
                                     "a directory holding one), or a local Hugging Face causal-LM "
                                     "directory of safetensors")
    model_name: str = _setting("", "name clients use for the model, one per worker (empty: from "
                                   "--model: a GGUF file's stem, a directory's name)")
    engine: str = _setting("continuous", "continuous (step-level batching on a paged KV cache) | "
                                         "static (the seed's padded batches, on transformers' classes)")
    batch: int = _setting(0, "most requests decoded together (0: continuous: as many as the KV "
                             "cache and --max-batch-tokens allow; static: 64)")
    wait_ms: float = _setting(5.0, "ms to wait for a batch to fill after its first request",
                              flag="--wait", env="WAIT_MS")
    dtype: str = _setting("auto", "auto | float32 | bfloat16 | float16 (auto: bfloat16 where "
                                  "the hardware supports it)")
    device: str = _setting("auto", "auto | cpu | cuda")
    # The continuous engine
    block_size: int = _setting(16, "tokens per block of the paged KV cache")
    kv_blocks: int = _setting(0, "blocks in the KV cache (0: as many as --kv-memory holds)")
    kv_memory: int = _setting(1024, "MiB of memory for the KV cache, when --kv-blocks is 0 (pages are "
                                    "touched only when used; a token costs 2 x layers x KV heads x "
                                    "head_dim x 2 bytes in bf16 or float16: docs/serving.md)")
    kv_dtype: str = _setting("auto", "auto | model | float16 | bfloat16: the KV cache's element type (auto: "
                                     "float16 on a CPU whose --dtype auto computes in float32, as llama.cpp "
                                     "keeps its cache, half the bytes a token; else the model's dtype)")
    max_batch_tokens: int = _setting(512, "tokens computed per step at most: decodes plus prefill "
                                          "chunks (a longer prompt is prefilled in chunks)")
    prefill_chunk: int = _setting(256, "most prompt tokens computed per step while others are "
                                       "decoding (fifo: 1 per decoding request, at least 16), so "
                                       "their streams keep flowing")
    step_fill: int = _setting(64, "while others decode, prompts whose chunks read a short context "
                                  "fill each step up to this many tokens (below it a step costs about "
                                  "the same: reading the weights, not arithmetic, bounds it)")
    max_stretch: float = _setting(2.0, "while others decode, prompt chunks may make a step take at "
                                       "most this many times as long as the decodes alone would (timed "
                                       "as it runs; 0: untimed, --step-fill alone)")
    scheduler: str = _setting("fifo", "fifo (decodes, then prompts, shortest rest first) | "
                                      "prefill-first")
    prefix_caching: bool = _setting(True, "share the KV blocks of prompts that start alike (a game's "
                                          "shared system prompt)")
    jump_forward: bool = _setting(True, "where a request's grammar allows exactly one next token (a key, "
                                        "punctuation, the rest of an enum value), append it without a step "
                                        "of its own: the forced run is computed as one chunk; the same text "
                                        "(docs/structured-output.md)")
    int4_rows: int = _setting(-1, "run the model's quantized layers (the GGUF's Q4_1 blocks and Q8_0 "
                                  "head) on the quantized kernel for steps of up to this many tokens, "
                                  "the dense product beyond (-1: every step, one numeric path whatever "
                                  "the step holds: batch-invariant; 0: never)")
    small_kernel: str = _setting("auto", "the quantized kernel: auto (int8 where this CPU has AVX-512 "
                                         "VNNI or AVX2, else bytes) | int8 (the activations rounded to "
                                         "8 bits, as llama.cpp does; batch-invariant) | int4 (torch's, exact "
                                         "weights) | bytes (float, any CPU) | dense (none: torch's "
                                         "product; not batch-invariant)")
    kernel_isa: str = _setting("native", "the instruction sets the C++ kernels are built for: native "
                                         "(all this CPU has) | avx2 (AVX2 only, as on a CPU without "
                                         "AVX-512: what such a worker writes, checked here; on such "
                                         "a CPU, the native build)")
    huge_pages: bool = _setting(True, "keep the weights the kernels read at every step in memory asked "
                                      "to be 2 MiB pages (Linux's transparent huge pages): a step streams "
                                      "them with fewer page walks; the same bits")
    int4_head: bool = _setting(False, "also requantize the output head to 4 bits (faster for one "
                                      "player, less exact)")
    torch_threads: int = _setting(0, "threads for the model's arithmetic (0: torch's choice, one "
                                     "per core)")
    cache_dir: str = _setting("~/.cache/storyteller", "where a worker keeps what makes its next "
                                                       "start faster: a GGUF's tokenizer and config, the "
                                                       "compiled kernels (empty: nowhere)")
    max_attempts: int = _setting(2, "times a job is retried when its worker dies holding it (the "
                                    "last retry runs alone); after that its client gets a "
                                    "'worker_crashed' error")
    metrics_port: int = _setting(0, "port of the worker's Prometheus /metrics (0: none; each worker on "
                                    "a host needs its own)")
    metrics_host: str = _setting("127.0.0.1", "address the worker's /metrics listens on (0.0.0.0 in a "
                                              "container, where Prometheus scrapes it from outside)")
    heartbeat_s: float = _setting(1.0, "seconds between worker heartbeats")
    heartbeat_ttl_s: float = _setting(3.0, "seconds without a heartbeat after which a worker is dead")
    answer_ttl_s: int = _setting(300, "seconds a final answer stays readable in Redis")

    def __post_init__(self):
        # REDIS_CLUSTER=1 turns the URL into its redis+cluster:// form, which is all that the code
        # reading the URL looks at (shared/redis_client.py), so every process treats it alike.
        if self.redis_cluster:
            object.__setattr__(self, "redis_url", as_cluster(self.redis_url))

    def __repr__(self) -> str:  # in place of the dataclass's, which would print keys and passwords
        shown = ", ".join(f"{f.name}={_shown(f, getattr(self, f.name))}" for f in fields(self))
        return f"Settings({shown})"

    @classmethod
    def from_env(cls, environ=os.environ) -> "Settings":
        values = {}
        for f in fields(cls):
            raw = environ.get(_env_name(f))
            if raw in (None, ""):
                continue
            try:
                values[f.name] = _parse_value(type(f.default), raw)
            except ValueError:
                raise SystemExit(f"{_env_name(f)}={_shown(f, raw)}: expected {type(f.default).__name__} "
                                 f"({f.metadata['help']})")
        try:
            return cls(**values)
        except ValueError as exc:  # settings that do not go together (REDIS_CLUSTER=1 with a Sentinel URL)
            raise SystemExit(str(exc))

    @classmethod
    def parse(cls, argv: Optional[Sequence[str]], flags: Sequence[str], description: str) -> "Settings":
        """Settings from the environment, overridden by the given flags (named by field)."""
        base = cls.from_env()
        parser = argparse.ArgumentParser(description=description)
        base.add_flags(parser, flags)
        given = {k: v for k, v in vars(parser.parse_args(argv)).items() if v is not None and k in flags}
        try:
            return replace(base, **given)
        except ValueError as exc:
            parser.error(str(exc))

    def add_flags(self, parser: argparse.ArgumentParser, flags: Sequence[str]) -> None:
        """A flag per named field, its help showing the env variable and this value as default."""
        by_name = {f.name: f for f in fields(self)}
        for name in flags:
            f = by_name[name]
            parser.add_argument(_flag_name(f), dest=name, default=None,
                                type=lambda raw, kind=type(f.default): _parse_value(kind, raw),
                                help=f"{f.metadata['help']} (env {_env_name(f)}, "
                                     f"default {shown_default(f, getattr(self, name))})".replace("%", "%%"))

    @staticmethod
    def env_name(name: str) -> str:
        """The environment variable of the field `name`."""
        return _env_name({f.name: f for f in fields(Settings)}[name])


# Every setting is in --help and the settings table (the tests' fault injection is not a setting:
# worker/faults.py).
DOCUMENTED = [f.name for f in fields(Settings)]


def shown_default(f, value) -> str:
    """A setting's value as --help and the settings table show it: as the environment takes it (a
    yes/no as 1/0), a secret hidden, a URL's password masked, nothing as 'empty'."""
    if f.metadata.get("secret") and value:
        return "<hidden>"
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, str):
        return masked(value) if value else "empty"
    return str(value)


def settings_table(flags: Sequence[str]) -> str:
    """The Markdown table of the named settings (env, flag, default, what), as docs/settings.md shows it:
    made from the same definitions as --help, so the two cannot disagree."""
    by_name = {f.name: f for f in fields(Settings)}
    defaults = Settings()
    rows = ["| env | flag | default | what |", "|---|---|---|---|"]
    for name in flags:
        f = by_name[name]
        default = shown_default(f, getattr(defaults, name))
        cells = [f"`{_env_name(f)}`", f"`{_flag_name(f)}`", default if default == "empty" else f"`{default}`",
                 f.metadata["help"].replace("<", "&lt;").replace(">", "&gt;")]  # <key> is no HTML tag
        rows.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(rows) + "\n"


def _shown(f, value) -> str:
    """A setting's value as help, repr and errors show it: a secret hidden, a URL's password masked."""
    if f.metadata.get("secret") and value:
        return "<hidden>"
    return repr(masked(value) if isinstance(value, str) else value)


def _parse_value(kind: type, raw: str):
    if kind is bool:  # bool("0") is True: spell the values out
        lowered = raw.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"not a yes/no value: {raw!r}")
    return kind(raw)


def _env_name(f) -> str:
    return f.metadata.get("env") or f.name.upper()


def _flag_name(f) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


# The table lives in docs/settings.md, between these markers; the README links to it.
SETTINGS_PAGE = "docs/settings.md"
README_START, README_END = "<!-- settings:start -->\n", "<!-- settings:end -->"


def update_readme(path: str) -> None:
    """Put the table between the page's markers, in place of the one there."""
    with open(path) as f:
        text = f.read()
    start, end = text.index(README_START) + len(README_START), text.index(README_END)
    with open(path, "w") as f:
        f.write(text[:start] + settings_table(DOCUMENTED) + text[end:])


if __name__ == "__main__":  # the settings table: printed, or written into its page
    parser = argparse.ArgumentParser(description=f"The settings' table as {SETTINGS_PAGE} shows it")
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--markdown", action="store_true", help="print it")
    action.add_argument("--update-readme", metavar="PAGE", nargs="?", const=SETTINGS_PAGE,
                        help=f"write it between the markers of PAGE (default: {SETTINGS_PAGE})")
    args = parser.parse_args()
    if args.update_readme:
        update_readme(args.update_readme)
    else:
        print(settings_table(DOCUMENTED), end="")
