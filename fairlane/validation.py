"""Semantic checks of an `InferenceRequest` beyond its schema.

`check_request` is the ONE owner of a request's cross-field rules (exactly one of
prompt / messages / prompt_token_ids, ranges of the sampling parameters, limits): the
producer library runs it before publishing (fail fast, nothing sent; the streamer
publishes through that library) and the dispatcher runs it again for requests that
were published straight to NATS. Edge schemas check only types and shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

from fairlane.protocol import ErrorCode, InferenceRequest, ProtocolError
from fairlane.subjects import check_reply_subject


@dataclass(frozen=True, slots=True)
class RequestLimits:
    max_tokens: int = 4096
    max_prompt_chars: int = 200_000
    max_prompt_tokens: int = 32_768
    max_stop_sequences: int = 8


def invalid(message: str, code: ErrorCode = ErrorCode.INVALID_REQUEST,
            param: str | None = None) -> ProtocolError:
    """`param`: the refused parameter's name, as the caller wrote it where the edges
    use the same name (sampling parameters, prompt, messages)."""
    return ProtocolError(message, code, param=param)


def prompt_chars(req: InferenceRequest) -> int:
    if req.prompt is not None:
        return len(req.prompt)
    if req.messages is not None:
        return sum(len(m.content) for m in req.messages)
    return 0


def check_request(req: InferenceRequest, limits: RequestLimits) -> InferenceRequest:
    """Raise `ProtocolError` with a clear message if `req` cannot be served."""
    given = [x is not None for x in (req.prompt, req.messages, req.prompt_token_ids)]
    if sum(given) != 1:
        raise invalid("exactly one of prompt, messages or prompt_token_ids must be set")
    if req.prompt is not None and not req.prompt.strip():
        raise invalid("prompt is empty", param="prompt")
    if req.messages is not None and (
        not req.messages or not any(m.content.strip() for m in req.messages)
    ):
        raise invalid("messages are empty", param="messages")
    if req.prompt_token_ids is not None and not req.prompt_token_ids:
        raise invalid("prompt_token_ids is empty", param="prompt_token_ids")
    if req.prompt_token_ids is not None and any(t < 0 for t in req.prompt_token_ids):
        raise invalid("prompt_token_ids must be non-negative", param="prompt_token_ids")
    sp = req.sampling
    if not 1 <= sp.max_tokens <= limits.max_tokens:
        raise invalid(f"max_tokens must be between 1 and {limits.max_tokens}, got {sp.max_tokens}",
                      param="max_tokens")
    if not 0.0 <= sp.temperature <= 2.0:
        raise invalid(f"temperature must be in [0, 2], got {sp.temperature}", param="temperature")
    if not 0.0 < sp.top_p <= 1.0:
        raise invalid(f"top_p must be in (0, 1], got {sp.top_p}", param="top_p")
    if len(sp.stop) > limits.max_stop_sequences:
        raise invalid(f"at most {limits.max_stop_sequences} stop sequences", param="stop")
    if any(not s for s in sp.stop):
        raise invalid("stop sequences must be non-empty", param="stop")
    if req.expected_output_tokens is not None and req.expected_output_tokens < 0:
        raise invalid("expected_output_tokens must be >= 0", param="expected_output_tokens")
    if prompt_chars(req) > limits.max_prompt_chars:
        raise invalid(
            f"prompt has {prompt_chars(req)} characters, over the limit of {limits.max_prompt_chars}",
            ErrorCode.PROMPT_TOO_LONG, param="prompt" if req.prompt is not None else "messages",
        )
    if req.prompt_token_ids is not None and len(req.prompt_token_ids) > limits.max_prompt_tokens:
        raise invalid(
            f"prompt has {len(req.prompt_token_ids)} tokens, over the limit of {limits.max_prompt_tokens}",
            ErrorCode.PROMPT_TOO_LONG, param="prompt_token_ids",
        )
    if req.resume is not None:
        r = req.resume
        if len(r.generated_token_ids) > sp.max_tokens:
            raise invalid(f"resume carries {len(r.generated_token_ids)} generated tokens, "
                          f"more than max_tokens {sp.max_tokens}")
        if any(t < 0 for t in r.generated_token_ids):
            raise invalid("resume.generated_token_ids must be non-negative")
        if r.next_seq < 0:
            raise invalid("resume.next_seq must be >= 0")
    check_reply_subject(req.reply_to)
    return req


def estimate_prompt_tokens(req: InferenceRequest) -> int:
    """Cheap prompt-length estimate (cost models, rate-limit reservations) before a
    tokenizer has seen it. The only one: every process estimates the same way.

    ~4 characters per token is the usual English BPE ratio; the estimate is trued up
    from the worker's actual count when the request finishes.
    """
    if req.prompt_token_ids is not None:
        return len(req.prompt_token_ids)
    return max(1, (prompt_chars(req) + 3) // 4)
