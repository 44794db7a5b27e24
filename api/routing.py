"""A conversation's next turn offered to the worker that answered its last one (shared/routing.py).

One MGET per request: the notes of every leading full block of its prompt, deepest first. The job is
offered to the worker of the deepest note that is live and not draining; that worker alone may take
it for --affinity-wait or two of its steps, the longer (`offer_wait`), then a worker that holds
nothing may, or any worker once the first one's heartbeat is late, and at once where it drains or is
full (the take script's rule, worker/job_queue.py). Priority order, the cap on waiting
jobs and the put-back of a dead worker's jobs are the queue's as always: an offer only says who looks
first.
"""
from __future__ import annotations

from typing import Optional

from shared import keys
from shared.protocol import WorkerInfo
from shared.routing import chain


def plan(client, model: str, prompts: list[list[int]], routing_key: str,
         workers: list[WorkerInfo]) -> tuple[list[str], Optional[str]]:
    """Each prompt's own digest, for its answer's note ('' for a prompt shorter than a block), and
    the worker to offer the request's jobs to (None: any). Only a request of one prompt is offered:
    a completions request of several may belong to several conversations."""
    chains = [chain(prompt, routing_key) for prompt in prompts]
    own = [links[-1] if links else "" for links in chains]
    if len(chains) != 1 or not chains[0]:
        return own, None
    notes = client.mget([keys.route_prefix(model) + digest for digest in chains[0]])
    taking = {w.id for w in workers if not w.draining}
    for note in reversed(notes):
        worker = note.decode() if isinstance(note, bytes) else note
        if worker in taking:
            return own, worker
    return own, None


# A worker takes jobs between its steps, so an offer shorter than the step it is in lapses before it
# can look: the offer lasts --affinity-wait or this many of the worker's recent steps, the longer
# (a 135M worker's step is tens of ms, a 1.7B one's on one thread hundreds), but never longer than
# OFFER_CAP_S, which bounds what a job offered to a busy worker can wait.
OFFER_STEPS = 2
OFFER_CAP_S = 2.0


def offer_wait(worker: Optional[str], workers: list[WorkerInfo], floor_s: float) -> float:
    """How long a job offered to `worker` is its alone: `floor_s` (--affinity-wait), or two of the
    steps its heartbeat says it takes (stats' step_s), up to OFFER_CAP_S."""
    step_s = next((float(w.stats.get("step_s") or 0) for w in workers if w.id == worker), 0.0)
    return max(floor_s, min(OFFER_CAP_S, OFFER_STEPS * step_s))
