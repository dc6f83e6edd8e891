"""Chat templates: a model's jinja template rendered as transformers renders it.

    text = ji.apply_chat_template(tok, [{"role": "user", "content": "Hi"}],
                                  add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False).ids

The template comes from the tokenizer (`tok.chat_template`, which `ji.load_tokenizer` fills from
an HF directory's tokenizer_config.json or a GGUF file's `tokenizer.chat_template`) or from the
`chat_template` argument. Rendering follows transformers' `apply_chat_template`: a sandboxed,
immutable jinja2 environment with `trim_blocks` and `lstrip_blocks`, the loop-control extension,
`raise_exception`, `strftime_now` and a `tojson` filter that keeps non-ASCII text, with the
tokenizer's special tokens (`bos_token`, `eos_token`, ...) in the context.
"""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """A template raised (`raise_exception`) or failed to render."""


def _raise_exception(message: str):
    raise ChatTemplateError(f"the chat template refused the conversation: {message}")


def _tojson(x: Any, ensure_ascii: bool = False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the chat template does not parse: {e}") from None


def _check_messages(messages: Sequence[Mapping]) -> None:
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence) or not messages:
        raise ValueError(f"messages must be a non-empty list of dicts, got {messages!r}")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{i}] is {type(m).__name__}, expected a dict")
        if not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}] has no string 'role': {m!r}")
        if "content" in m and not isinstance(m["content"], str | list | type(None)):
            raise ValueError(f"messages[{i}]['content'] is {type(m['content']).__name__}")


def apply_chat_template(
    tokenizer: Any,
    messages: Sequence[Mapping],
    add_generation_prompt: bool = False,
    *,
    chat_template: str | None = None,
    **kwargs: Any,
) -> str:
    """Renders a conversation with the model's chat template.

    Args:
      tokenizer: a tokenizer from `ji.load_tokenizer` (its `chat_template` and `special_tokens`
        are read if present); may be None when `chat_template` is given.
      messages: [{"role": ..., "content": ...}, ...].
      add_generation_prompt: end with the prompt that opens the assistant's turn.
      chat_template: a template overriding the tokenizer's.
      **kwargs: extra template variables (tools, documents, ...), as transformers passes them.

    Returns:
      The rendered text (tokenize it without adding special tokens: the template holds them).

    Raises:
      ValueError: no template, malformed messages, or a template that refuses the conversation.
    """
    template = chat_template if chat_template is not None else getattr(
        tokenizer, "chat_template", None
    )
    if not template:
        raise ValueError(
            "this tokenizer has no chat template (tokenizer_config.json's chat_template or GGUF "
            "metadata tokenizer.chat_template); pass chat_template=... explicitly"
        )
    if not isinstance(template, str):
        raise ValueError(f"chat_template must be a string, got {type(template).__name__}")
    _check_messages(messages)
    context: dict[str, Any] = dict(getattr(tokenizer, "special_tokens", None) or {})
    context.update(kwargs)
    try:
        return _compile(template).render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=bool(add_generation_prompt),
            **context,
        )
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the chat template failed to render: {e}") from None
