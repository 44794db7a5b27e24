"""The messages that cross Redis: jobs (API -> worker), results (worker -> API), worker announcements.

Everything is JSON, never pickle: any process, in any language, can read the queue.
"""
from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Optional, Union


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    seed: Optional[int] = None  # same seed, same text
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False  # keep writing past end-of-text (benchmarks that need equal work)
    # What follows changes the logits before the pick (worker/logits.py), per row inside the step;
    # a job sends only the fields it sets (Job.to_json), so a worker that predates one still reads
    # every job that does not use it, and the API sends a job that does only to workers that
    # announce the feature (WorkerInfo.features).
    presence_penalty: float = 0.0  # OpenAI's: minus this once a token has been written (-2..2)
    frequency_penalty: float = 0.0  # minus this per time it has been written (-2..2)
    repetition_penalty: float = 1.0  # CTRL's, as HF and vLLM: prompt and output tokens' logits /(x)
    min_p: float = 0.0  # drop tokens less likely than min_p x the likeliest (after temperature)
    logit_bias: dict[str, float] = field(default_factory=dict)  # token id (a JSON key) -> -100..100
    stop_token_ids: list[int] = field(default_factory=list)  # finish "stop" on any (not in the text)
    min_tokens: int = 0  # end-of-text and stop_token_ids are masked until this many are written
    # Log-probabilities, of the model's own log-softmax (before temperature, penalties, masks):
    # None: none; k >= 0: each written token's, with the k likeliest beside it.
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None  # the same for each prompt token after the first (echo)
    # The hash of a compiled-constraint grammar stored at keys.grammar(model, hash) (api/grammars.py):
    # every token is picked under its mask.
    grammar: Optional[str] = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


# What a worker can honour beyond plain sampling (WorkerInfo.features): the API refuses a request
# that needs one its model's live workers do not all announce, rather than queue a job they drop.
FEATURE_PENALTIES = "penalties"  # presence/frequency/repetition penalties, min_p, logit_bias,
#                                  stop_token_ids, min_tokens
FEATURE_LOGPROBS = "logprobs"  # logprobs of written tokens
FEATURE_PROMPT_LOGPROBS = "prompt_logprobs"  # and of the prompt's (echo with logprobs)
FEATURE_GRAMMAR = "grammar"  # structured output: a grammar's mask on every pick
FEATURES = (FEATURE_PENALTIES, FEATURE_LOGPROBS, FEATURE_PROMPT_LOGPROBS, FEATURE_GRAMMAR)
# The one table of which SamplingParams field needs which feature, in the order a refusal names them;
# the fields not here (max_tokens, temperature, top_p, top_k, seed, stop, ignore_eos) are plain
# sampling, which every engine honours.
PARAM_FEATURES = {"presence_penalty": FEATURE_PENALTIES, "frequency_penalty": FEATURE_PENALTIES,
                  "repetition_penalty": FEATURE_PENALTIES, "min_p": FEATURE_PENALTIES,
                  "logit_bias": FEATURE_PENALTIES, "stop_token_ids": FEATURE_PENALTIES,
                  "min_tokens": FEATURE_PENALTIES, "logprobs": FEATURE_LOGPROBS,
                  "prompt_logprobs": FEATURE_PROMPT_LOGPROBS, "grammar": FEATURE_GRAMMAR}
_PARAM_DEFAULTS = {f.name: (f.default_factory() if f.default_factory is not MISSING else f.default)
                   for f in fields(SamplingParams)}


def params_json(params: SamplingParams) -> dict:
    """The fields of `params` away from their defaults (max_tokens always): what a job carries."""
    return {name: value for name, value in asdict(params).items()
            if name == "max_tokens" or value != _PARAM_DEFAULTS[name]}


def features_needed(params: SamplingParams) -> dict[str, str]:
    """Each feature `params` needs -> the first field that asks for it (PARAM_FEATURES' order)."""
    needed: dict[str, str] = {}
    for name, feature in PARAM_FEATURES.items():
        if getattr(params, name) != _PARAM_DEFAULTS[name]:
            needed.setdefault(feature, name)
    return needed


# Priority, as vLLM's: lower is served first; a worker takes from the most urgent non-empty queue.
# Bounded, so each value has its own queue (and metric label).
PRIORITY_MIN, PRIORITY_DEFAULT, PRIORITY_MAX = -10, 0, 10
PRIORITIES = range(PRIORITY_MIN, PRIORITY_MAX + 1)


@dataclass
class Job:
    """One choice to write: a prompt already tokenized by the API, and how to sample it."""
    id: str
    model: str
    prompt_ids: list[int]
    params: SamplingParams
    # Seconds from its queueing after which nobody waits for the answer. A duration, not a time:
    # hosts' clocks differ, so a worker measures the job's age in Redis' clock (`enqueued_at`).
    timeout_s: float
    stream: bool = False  # publish text as it is written; otherwise only the final answer
    # When it was queued, in Redis' clock (TIME, unix seconds): the API's admission script writes it
    # in place of the 0.0 as it pushes the job. Its age, against Redis' clock again, gives the
    # deadline, the workers' queue wait and the queue's oldest-job age. 0: not stamped.
    enqueued_at: float = 0.0
    # Routing (shared/routing.py): the digest of its prompt up to its last full block, which the
    # worker that answers it notes as its own (keys.route_prefix); and the worker it is offered to
    # first, which alone may take it until offer_until (ms of Redis' clock, which the admission
    # script writes in place of the 0 as it pushes the job: --affinity-wait from then), unless that
    # worker's heartbeat is gone. Empty: any worker, as always.
    route: str = ""
    offer: str = ""
    offer_until: int = 0
    # Last, always: worker/job_queue.py's Lua reads it from the end of the JSON (and `id` from its start).
    priority: int = PRIORITY_DEFAULT

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "params": params_json(self.params)}, separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: Union[str, bytes]) -> "Job":
        data = json.loads(raw)
        data["params"] = SamplingParams(**data["params"])
        return cls(**data)


# Results, published on the job's channel. `type` tells them apart.

@dataclass
class TextDelta:
    """Text written since the last message (may be several tokens' worth).

    `offset` is where it starts in the job's whole text: a job put back after its worker died
    resumes from its record of written tokens, and its new worker's first delta starts at 0 with
    the text rebuilt from them (or, without a record, the job is written again from the start):
    the API must not send that text twice.
    """
    text: str
    offset: int
    completion_tokens: int
    # With params.logprobs: one entry per token whose text is in `text` (a token whose text is held
    # back, half a character or a possible stop string, comes with the text it makes), each
    # [token id, logprob, text offset in the whole answer, [[id, logprob], ...the k likeliest]];
    # `logprobs_start` is the first entry's index among the answer's tokens (as `offset` is the
    # text's), so a resumed job's repeat is skipped by the API as its text is.
    logprobs: Optional[list] = None
    logprobs_start: int = 0
    # With params.prompt_logprobs, on a job's first delta (Final.prompt_logprobs' form): a stream's
    # echo sends the prompt, with its logprobs, before the answer.
    prompt_logprobs: Optional[list] = None
    type: str = "text"


@dataclass
class Final:
    """The whole answer; the last message of a job."""
    text: str
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int
    completion_tokens: int
    logprobs: Optional[list] = None  # every written token's entry (TextDelta.logprobs' form)
    # With params.prompt_logprobs: an entry per prompt token, the first's logprob None (nothing
    # before it), in the same form; text offsets count in the prompt's text.
    prompt_logprobs: Optional[list] = None
    cached_tokens: int = 0  # prompt tokens the prefix cache held (usage.prompt_tokens_details)
    type: str = "final"


@dataclass
class Failure:
    """The job could not be written; also a last message."""
    message: str
    code: str = "worker_error"
    type: str = "error"


Result = Union[TextDelta, Final, Failure]
_RESULT_TYPES = {"text": TextDelta, "final": Final, "error": Failure}


def encode_result(result: Result) -> str:
    return json.dumps(asdict(result), separators=(",", ":"))


def decode_result(raw: Union[str, bytes]) -> Result:
    data = json.loads(raw)
    return _RESULT_TYPES[data["type"]](**data)


@dataclass
class WorkerInfo:
    """What a worker announces in its heartbeat, so the API knows which models are served."""
    id: str
    model: str
    context_window: int
    engine: str
    batch: int
    device: str
    dtype: str
    tokenizer_digest: str  # changes when the tokenizer stored in Redis changes
    pid: int
    host: str
    started: float
    draining: bool = False  # stopping: finishes what it holds, takes nothing new
    # How this worker computes (kernel path, dtype, kernel build): workers with the same one write
    # the same tokens for the same request; "+invariant" where a row's numbers do not depend on
    # what shares its step (docs/serving.md, "Same request, same text").
    numerics: str = ""
    features: list[str] = field(default_factory=list)  # of FEATURES, those its engine honours
    stats: dict = field(default_factory=dict)  # the engine's own: KV cache usage, requests held

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: Union[str, bytes]) -> "WorkerInfo":
        known = {f.name for f in fields(cls)}  # a newer worker's extra fields are not this API's business
        return cls(**{k: v for k, v in json.loads(raw).items() if k in known})
