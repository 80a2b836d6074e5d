"""Render chat messages to a prompt string for engines that take text.

The model's own chat template (the tokenizer's ``chat_template``) is used when there
is one. Without it we fall back to a deliberately plain template rather than refuse
the request, so a base model (or a test model) still accepts ``messages``::

    system: You are terse.
    user: Hi
    assistant:

The fallback is documented behaviour, not an accident: it is not what any chat-tuned
model was trained on, so production pools should serve models that ship a template.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

FALLBACK_GENERATION_PROMPT = "assistant:"


class _ChatMessageLike(Protocol):
    role: str
    content: str


def fallback_chat_prompt(messages: Iterable[_ChatMessageLike]) -> str:
    """``role: content`` per line, then ``assistant:`` to cue the reply."""
    lines = [f"{m.role}: {m.content}\n" for m in messages]
    return "".join(lines) + FALLBACK_GENERATION_PROMPT


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_chat(tokenizer: Any, messages: Iterable[_ChatMessageLike]) -> str:
    """The prompt text for `messages`, using the tokenizer's template when it has one.

    The rendered text already carries whatever special tokens the template adds (a
    BOS, role markers), so callers should tokenize it without adding special tokens.
    """
    messages = list(messages)
    if tokenizer is None or not has_chat_template(tokenizer):
        return fallback_chat_prompt(messages)
    conversation = [{"role": m.role, "content": m.content} for m in messages]
    rendered = tokenizer.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=True
    )
    if not isinstance(rendered, str):  # some tokenizers return a list of one
        rendered = "".join(rendered)
    return rendered
