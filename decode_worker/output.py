"""What a decode instance streams per step: each request's new token ids and their extras
(engine/core/extras.py: logprobs), no text.

Text (detokenization, stop strings) is the front end's (engine/text/detokenize.py): a stop string found there
ends the request here by an abort. Every output says where its tokens stand in the request's output
(`start`), so a consumer joins streams from two instances without de-duplicating anything: a
disaggregated request's first token is the prefill's to hand over, and this instance's outputs of it
begin at position 1.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.core.request import Request


@dataclass(frozen=True)
class RequestOutput:
    """One step's news of one request, streamed to its router: immutable once made."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    start: int = 0  # the position of new_token_ids[0] in the request's output (of the next token, if none)
    error: str | None = None
    new_extras: list[dict] | None = None  # one per new token, when the request asked (carried unread)
    # with the first token of a prompt computed here (start 0): its tokens served from the prefix cache
    num_cached_tokens: int | None = None
    kv_load_failed: bool = False  # the error is a failed KV transfer (the router may recompute here)


class OutputProcessor:
    """Per request, how many of its output tokens were handed over already (by this instance's outputs
    or, for the first token of a remote-prefilled request, by the prefill instance)."""

    def __init__(self):
        self.num_sent: dict[str, int] = {}

    def add_request(self, request_id: str, num_handed_over: int = 0) -> None:
        """`num_handed_over`: output tokens another instance streams (1: the prefill's first token)."""
        self.num_sent[request_id] = num_handed_over

    def fork(self, parent_id: str, children: list[Request]) -> None:
        """A request became its n choices (Scheduler._fork): each streams its own tokens from where
        the parent stood (each choice's first token is handed over as the parent's was)."""
        num = self.num_sent.pop(parent_id, 0)
        for child in children:
            self.num_sent[child.request_id] = num

    def process(self, reqs: list[Request]) -> list[RequestOutput]:
        """The outputs of this step for the requests that got a token or finished."""
        outputs = []
        for req in reqs:
            start = self.num_sent.get(req.request_id)
            if start is None:
                continue
            new_ids = req.output_token_ids[start:]
            extras = None
            if req.sampling_params.wants_extras:
                extras = req.output_extras[start:]
                assert len(extras) == len(new_ids), (req.request_id, len(extras), len(new_ids))
            self.num_sent[req.request_id] = req.num_output_tokens
            cached = req.num_cached_tokens if start == 0 and new_ids else None
            outputs.append(RequestOutput(req.request_id, new_ids, req.is_finished, req.status.finish_reason, start,
                                         new_extras=extras, num_cached_tokens=cached))
            if req.is_finished:
                del self.num_sent[req.request_id]
        return outputs

    def abort(self, request_id: str) -> None:
        self.num_sent.pop(request_id, None)
