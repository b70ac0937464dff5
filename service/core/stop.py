"""When a request stops: the one place that decides it, after each token it is given."""

from __future__ import annotations

from service.core.outputs import FinishReason
from service.core.request import Request


def stop_reason(request: Request, max_model_len: int) -> FinishReason | None:
    """Why the request must stop after its last output token, or None to go on.

    STOP on a stop token id, or an eos token unless ignore_eos, but not before min_new_tokens tokens
    came first (the sampler masks those ids until then; a stop still cannot happen early if a caller
    feeds tokens some other way). LENGTH at max_new_tokens, or when the context is full. Stop strings
    are matched on text, outside the engine thread. STOP too when the reply completed its grammar (a
    response format): nothing but eos could follow, so the reply ends here whatever min_new_tokens says."""
    p = request.params
    token_id = request.output_token_ids[-1]
    if request.matcher is not None and request.matcher.done:
        return FinishReason.STOP
    may_stop = request.num_output_tokens > p.min_new_tokens
    if may_stop and (token_id in p.stop_token_ids or (token_id in p.eos_token_ids and not p.ignore_eos)):
        return FinishReason.STOP
    if request.num_output_tokens >= p.max_new_tokens or request.num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None
