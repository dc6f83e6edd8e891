"""Chat templates: a model's jinja template rendered as transformers renders it.

    text = ji.apply_chat_template(tok, [{"role": "user", "content": "Hi"}],
                                  add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False).ids

The template comes from the tokenizer (`tok.chat_template`, which `ji.load_tokenizer` fills from
an HF directory's tokenizer_config.json / chat_template.jinja or a GGUF file's
`tokenizer.chat_template`) or from the `chat_template` argument. Rendering follows transformers'
`apply_chat_template(..., tokenize=False)`: a sandboxed, immutable jinja2 environment with
`trim_blocks` and `lstrip_blocks`, the loop-control extension and `{% generation %}` blocks,
`raise_exception`, `strftime_now`, a `tojson` filter that keeps non-ASCII text, a `namespace` that
refuses underscore names; messages are copied to plain JSON data with None-valued keys dropped and
reasoning aliased (`reasoning_content`, `thinking`, `reasoning`); `tools` and `documents` are
always defined (None by default); the tokenizer's special tokens (`bos_token`, `eos_token`, ...)
are in the context, under the caller's keyword arguments.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.nodes
import jinja2.utils
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Names a message's reasoning goes under; templates read the first, gpt-oss ones `thinking`.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# What transformers appends to the final message to find where it ends after rendering.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


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


class _GenerationBlocks(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for transformers' assistant
    masks; rendering text, the block is its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """jinja's `namespace()`, refusing underscore names (a way towards CPython internals)."""

    def __init__(*args, **kwargs):  # jinja's own signature trick, so namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot set underscore attributes on a namespace ({name!r})"
            )


class _Dict:
    """`dict(...)` for templates, without the type's attributes."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlocks, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the chat template does not parse: {e}") from None


def _plain(value: Any) -> Any:
    """A copy made of JSON types only (a template in the sandbox sees no caller objects); other
    objects become a placeholder naming their type, as in transformers."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if hasattr(value, "item") and callable(value.item) and getattr(value, "shape", None) == ():
        return _plain(value.item())  # numpy scalars: np.bool_(False) must stay falsy
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic messages (the OpenAI SDK's)
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _prepare(messages: Sequence[Mapping]) -> list[dict]:
    """Plain copies without None-valued keys (APIs send content=None, tool_calls=None, which
    templates render as "None"), reasoning under every name templates read."""
    out = []
    for m in messages:
        m = {_plain(k): _plain(v) for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def _is_list(x: Any) -> bool:
    return isinstance(x, Sequence) and not isinstance(x, str | bytes)


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


def _tag_final_message(chat: list[dict], field: str, template: str) -> str:
    """Appends the continue tag to the final message; returns the text to continue."""
    final = chat[-1].get(field)
    if final is None:
        raise ValueError(f"continue_final_message: the final message has no {field!r}")
    fields = [field]
    if field in _REASONING_FIELDS:
        fields = [f for f in _REASONING_FIELDS if chat[-1].get(f) == final]
    if not any(f in template for f in fields):
        raise ValueError(f"continue_final_message: the chat template never reads {field!r}")
    if isinstance(final, list | tuple):
        for block in reversed(final):
            if isinstance(block, dict) and "text" in block:
                text, block["text"] = block["text"], block["text"] + _CONTINUE_TAG
                return text
        raise ValueError("continue_final_message: the final message has no text block")
    for f in fields:
        chat[-1][f] = chat[-1][f] + _CONTINUE_TAG
    return final


def apply_chat_template(
    tokenizer: Any,
    messages: Sequence[Mapping],
    add_generation_prompt: bool = False,
    *,
    chat_template: str | None = None,
    continue_final_message: bool | str = False,
    tools: Sequence[Mapping] | None = None,
    documents: Sequence[Mapping] | None = None,
    **kwargs: Any,
) -> str:
    """Renders a conversation with the model's chat template, as transformers'
    `apply_chat_template(..., tokenize=False)` does.

    Args:
      tokenizer: a tokenizer from `ji.load_tokenizer` (its `chat_template` and `special_tokens`
        are read if present); may be None when `chat_template` is given.
      messages: [{"role": ..., "content": ...}, ...].
      add_generation_prompt: end with the prompt that opens the assistant's turn.
      chat_template: a template overriding the tokenizer's.
      continue_final_message: end inside the final message (True: its "content"; a string:
        that field), so generation continues it; excludes add_generation_prompt.
      tools: JSON schemas of tools, for templates that render them.
      documents: [{"title": ..., "text": ...}] for retrieval templates.
      **kwargs: extra template variables; they override the special tokens of the same name.

    Returns:
      The rendered text (tokenize it without adding special tokens: the template holds them).

    Raises:
      ValueError: no template, malformed messages, or a template that refuses the conversation.
    """
    template = (
        chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    )
    if not template:
        raise ValueError(
            "this tokenizer has no chat template (tokenizer_config.json's chat_template or GGUF "
            "metadata tokenizer.chat_template); pass chat_template=... explicitly"
        )
    if not isinstance(template, str):
        raise ValueError(f"chat_template must be a string, got {type(template).__name__}")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt exclude each other")
    if tools is not None and (
        not _is_list(tools) or any(not isinstance(t, Mapping) for t in tools)
    ):
        raise ValueError(f"tools must be a list of JSON schemas (dicts), got {tools!r}")
    if documents is not None and (
        not _is_list(documents) or any(not isinstance(d, Mapping) for d in documents)
    ):
        raise ValueError(
            f"documents must be a list of dicts with 'title' and 'text', got {documents!r}"
        )
    _check_messages(messages)
    chat = _prepare(messages)
    final = None
    if continue_final_message:
        field = continue_final_message if isinstance(continue_final_message, str) else "content"
        final = _tag_final_message(chat, field, template)
    context: dict[str, Any] = dict(getattr(tokenizer, "special_tokens", None) or {})
    context.update(_plain(kwargs))
    try:
        text = _compile(template).render(
            messages=chat,
            tools=_plain(tools),
            documents=_plain(documents),
            add_generation_prompt=add_generation_prompt,
            **context,
        )
    except ChatTemplateError:
        raise
    except (jinja2.TemplateError, ArithmeticError, LookupError, TypeError, ValueError) as e:
        # What the template's own expressions raise over the caller's data (`bos_token + 1`
        # with a string bos_token) is its failure to render, not ours.
        raise ChatTemplateError(f"the chat template failed to render: {e}") from None
    if final is None:
        return text
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise ValueError(
            "continue_final_message: the rendered chat does not hold the final message (the "
            "template changes it)"
        )
    at = text.rindex(tag)
    # A template that strips the message also strips the tag's space, and maybe the message's.
    return text[:at] if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
