"""What a request gets per token besides the token id: its *extras*, one msgpack-able map per token
(today {"logprobs": {token id: logprob, ...}}, the sampled token first).

The sampler fills them (engine/sample/sampling.py `token_extras`) and the front ends read them
(gateway/session.py, decode_worker/llm.py). Everything between carries them unread: the runner's
output (engine/core/request.py), the decode scheduler's `Request.output_extras`, the handover trailer
(engine/core/request.py), a decode step's output and the router's stream. So a new per-token output
is one entry in FIELDS here, its request parameter (engine/core/request.py `wants_extras`), its
producer and its readers; no carrier changes (docs/architecture.md, "A per-token output field").

FIELDS checks each field's value where extras arrive from another instance (a handover trailer): a
malformed one fails its request, never the instance.
"""
from __future__ import annotations

Extras = dict[str, object]


def _is_logprobs(value) -> bool:
    return (isinstance(value, dict) and bool(value)
            and all(type(t) is int and t >= 0 and isinstance(lp, float) for t, lp in value.items()))


FIELDS = {"logprobs": _is_logprobs}  # field name -> check of its value


def misfit(extras) -> str | None:
    """Why `extras` is not one token's extras map (None: it is)."""
    if not isinstance(extras, dict) or not extras:
        return f"extras are a {type(extras).__name__}, not a non-empty map"
    for name, value in extras.items():
        check = FIELDS.get(name)
        if check is None:
            return f"unknown extras field {name!r}"
        if not check(value):
            return f"extras field {name!r} is malformed"
    return None
