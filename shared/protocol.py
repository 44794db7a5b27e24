"""The messages that cross Redis: jobs (API -> worker), results (worker -> API), worker announcements.

Everything is JSON, never pickle: any process, in any language, can read the queue.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


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
    # Last, always: worker/job_queue.py's Lua reads it from the end of the JSON (and `id` from its start).
    priority: int = PRIORITY_DEFAULT

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

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
    type: str = "text"


@dataclass
class Final:
    """The whole answer; the last message of a job."""
    text: str
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int
    completion_tokens: int
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
    stats: dict = field(default_factory=dict)  # the engine's own: KV cache usage, requests held

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: Union[str, bytes]) -> "WorkerInfo":
        return cls(**json.loads(raw))
