"""What a request needs of its workers beyond plain sampling, checked against what they announce.

A worker lists the features its engine honours (WorkerInfo.features, shared/protocol.FEATURES). A
request that needs one is refused at the API, naming the field that asked for it, unless every live
worker of its model announces it: any of them may take the job, and one that predates a field would
drop the job as malformed, or worse, write as if the field was never sent.
"""
from __future__ import annotations

from api.errors import bad_request
from api.validation import CompletionRequest
from shared.protocol import FEATURE_GRAMMAR, FEATURE_PROMPT_LOGPROBS, WorkerInfo, features_needed


def required_features(req: CompletionRequest) -> dict[str, str]:
    """Each feature the request needs -> the request field that asks for it (the first, if several):
    shared/protocol.PARAM_FEATURES' field, named as the request names it."""
    needed = features_needed(req.params)
    if FEATURE_PROMPT_LOGPROBS in needed:
        needed[FEATURE_PROMPT_LOGPROBS] = "echo"  # echo with logprobs asks for the prompt's
    # A grammar comes from one of three request fields (its hash is set in params once compiled).
    needed.pop(FEATURE_GRAMMAR, None)
    if req.response_format is not None:  # json_object or json_schema ({"type": "text"} is None)
        needed[FEATURE_GRAMMAR] = "response_format"
    elif req.structured_outputs is not None:
        needed[FEATURE_GRAMMAR] = "structured_outputs"
    elif req.tools and req.tool_choice != "none":
        needed[FEATURE_GRAMMAR] = "tools"
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
