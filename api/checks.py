"""What a request is checked against once its model's workers are known; api/validation.py
checks the body alone, before.

Features. A worker lists the features its engine honours (WorkerInfo.features,
shared/protocol.FEATURES). A request that needs one is refused, naming the field that asked for it,
unless every live worker of its model announces it: any of them may take the job, and one that
predates a field would drop the job as malformed, or worse, write as if the field was never sent.

The context window and the vocabulary. More max_tokens than the whole window, or a token id the
model does not have, is the client's mistake: a 400. A prompt must leave room to write (checked
once it is tokenized); max_tokens beyond that room is cut to it, as OpenAI does.
"""
from __future__ import annotations

from api.errors import bad_request
from api.validation import CompletionRequest
from shared.protocol import FEATURE_GRAMMAR, FEATURE_PROMPT_LOGPROBS, WorkerInfo, features_needed


def check(req: CompletionRequest, workers: list[WorkerInfo], tokenizer) -> None:
    """Every check the workers decide that needs no prompt tokenized: all before the queue's cap,
    so a request that can never be answered hears so rather than a 429 to retry."""
    check_features(req, workers)
    check_max_tokens(req, workers[0].context_window)
    check_token_ids(req, tokenizer.vocab_size)


def required_features(req: CompletionRequest) -> dict[str, str]:
    """Each feature the request needs -> the request field that asks for it (the first, if several):
    shared/protocol.PARAM_FEATURES' field, named as the request names it."""
    needed = features_needed(req.params)
    if FEATURE_PROMPT_LOGPROBS in needed:
        needed[FEATURE_PROMPT_LOGPROBS] = "echo"  # echo with logprobs asks for the prompt's
    # The grammar's hash is set in params only once compiled: the request's fields say it is coming.
    needed.pop(FEATURE_GRAMMAR, None)
    if req.constraints:
        needed[FEATURE_GRAMMAR] = req.constraints[0]
    return needed


def check_features(req: CompletionRequest, workers: list[WorkerInfo]) -> None:
    """A 400 `unsupported_parameter` for a field whose feature some live worker of the model lacks."""
    for feature, param in required_features(req).items():
        lacking = [w for w in workers if feature not in w.features]
        if lacking:
            engines = ", ".join(sorted({w.engine for w in lacking}))
            raise bad_request(
                f"'{param}' is not supported by the workers serving {req.model} (the static engine, or an "
                f"older version): {len(lacking)} of its {len(workers)} live workers ({engines}) do not "
                f"announce '{feature}'; run them on this version's continuous engine, or leave '{param}' out",
                param=param, code="unsupported_parameter")


def check_max_tokens(req: CompletionRequest, context_window: int) -> None:
    """More tokens than the model's whole window is a mistake, not a wish to fill it: a 400.
    (max_tokens within the window but beyond the room the prompt leaves is cut to the room: room.)"""
    if req.max_tokens is not None and req.max_tokens > context_window:
        raise bad_request(f"'{req.max_tokens_param}' is {req.max_tokens}, more than this model's context window "
                          f"of {context_window} tokens", param=req.max_tokens_param, code="invalid_value")


def check_token_ids(req: CompletionRequest, vocab_size: int) -> None:
    """logit_bias', stop_token_ids' and a prompt's ids must be the model's (known once its tokenizer is)."""
    for name, ids in (("logit_bias", map(int, req.params.logit_bias)), ("stop_token_ids", req.params.stop_token_ids)):
        outside = [t for t in ids if t >= vocab_size]
        if outside:
            raise bad_request(f"'{name}' names token id {max(outside)}, outside the vocabulary (size {vocab_size})",
                              param=name, code="invalid_value")
    for prompt in req.prompts:
        if not isinstance(prompt, str) and max(prompt) >= vocab_size:
            raise bad_request(f"token id {max(prompt)} is outside the vocabulary (size {vocab_size})",
                              param="prompt", code="invalid_value")


def room(req: CompletionRequest, prompts: list[list[int]], context_window: int) -> list[int]:
    """Each tokenized prompt's max_tokens: what the request asked (all the room, if nothing), cut to
    the room the prompt leaves in the window; a 400 for a prompt that leaves none."""
    rooms = []
    for prompt in prompts:
        left = context_window - len(prompt)
        if left < 1:
            raise bad_request(
                f"this model's maximum context length is {context_window} tokens, and the prompt "
                f"has {len(prompt)} tokens, which leaves no room to write: shorten the prompt",
                param="messages" if req.messages else "prompt", code="context_length_exceeded")
        rooms.append(min(req.max_tokens or left, left))
    return rooms
