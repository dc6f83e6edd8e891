"""The OpenAI request bodies as strict pydantic models, their mapping to `SamplingParams`, and a
chat request's prompt (its messages rendered by the chat template).

Field names and defaults follow the OpenAI API (and vLLM's extensions `top_k`, `min_p`,
`ignore_eos`, `stop_token_ids`, `include_stop_str_in_output`, `skip_special_tokens`,
`spaces_between_special_tokens`, `truncate_prompt_tokens`, `bad_words`, `prompt_logprobs`,
`add_special_tokens`, chat's `continue_final_message`; its `/tokenize` and `/detokenize` bodies are
in `tokenization.py`). Types are strict: a string where a number belongs, a float where an int
belongs, or a bool where a number belongs is a 400 naming the field; unknown fields are ignored
(clients send vendor extras). `presence_penalty`, `frequency_penalty`, `logit_bias` (OpenAI),
`repetition_penalty`, `min_tokens`, `allowed_token_ids` and `bad_words` (vLLM; tokenized by
`tokenization.bad_words_ids`) map to the engine's penalties and masks (`jaxinfer.penalties`).
Known fields that change the output but that the engine does not implement (`best_of` other
than n, `suffix`, tools, vLLM's guided decoding and others: `UNIMPLEMENTED`) are accepted only
at their neutral value and refused by name otherwise.

Errors are raised as `APIError(status, message, param)` and rendered in the OpenAI shape
`{"error": {"message", "type", "param", "code"}}` by the app.
"""

from __future__ import annotations

import math
import random
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from jaxinfer.chat import apply_chat_template
from jaxinfer.checks import INT32_MAX
from jaxinfer.sampling import MIN_POSITIVE, SamplingParams
from jaxinfer.server.detokenizer import TextOptions

MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit (the engine's too; vLLM's default max_logprobs)
# The roles of OpenAI's chat messages; content may be null or absent only where its types allow
# (an assistant turn of tool calls, a function's result); tool results need content.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
_NULL_CONTENT_ROLES = ("assistant", "function")
# apply_chat_template's arguments that the chat route sets itself: not chat_template_kwargs.
_TEMPLATE_ARGS = frozenset(
    {"tokenizer", "messages", "add_generation_prompt", "continue_final_message", "chat_template"}
)


class APIError(Exception):
    """An error response: HTTP status, message, the offending request field (or None)."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code = code

    @property
    def type(self) -> str:
        if self.status == 404:
            return "NotFoundError"
        if self.status == 503:
            return "ServiceUnavailableError"
        if self.status >= 500:
            return "InternalServerError"
        return "BadRequestError" if self.status == 400 else "InvalidRequestError"

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code if self.code is not None else self.status,
            }
        }


class StrictModel(BaseModel):
    """A request body: strict types (no coercion of "1" to 1), unknown fields ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(StrictModel):
    include_usage: bool = False


class SamplingFields(StrictModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM extension; -1 or 0: off
    min_p: float | None = None  # vLLM extension
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM extension
    ignore_eos: bool = False  # vLLM extension
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None  # [-2, 2]
    frequency_penalty: float | None = None  # [-2, 2]
    repetition_penalty: float | None = None  # vLLM extension; [0.01, 100]
    logit_bias: dict[str, float] | None = None  # {"token id": bias in [-100, 100]}
    min_tokens: int | None = None  # vLLM extension; no stop token or string before this many
    allowed_token_ids: list[int] | None = None  # vLLM extension; the only ids sampled
    # vLLM extensions of the text (None: vLLM's default, False / True / True).
    include_stop_str_in_output: bool | None = None  # keep the stop string / stop token's text
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    truncate_prompt_tokens: int | None = None  # keep the last k prompt tokens; -1: all that fit
    bad_words: list[str] | None = None  # vLLM extension; banned words (bad_words_ids)
    prompt_logprobs: int | None = None  # vLLM extension; top-k per prompt token (not streamed)
    # Known, accepted only at their neutral value (UNIMPLEMENTED below).
    best_of: int | None = None
    user: str | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    logits_processors: Any = None
    use_beam_search: Any = None
    truncation_side: Any = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True  # vLLM's: the tokenizer's post-processor (a BOS) on a text


class ChatMessage(BaseModel):
    # Messages are template input: extra keys (name, tool_calls, ...) pass through to it.
    model_config = ConfigDict(strict=True, extra="allow")
    role: str  # one of CHAT_ROLES (checked by chat_messages, which names the bad value)
    content: str | list[Any] | None = None  # a list: text parts, checked by chat_messages


class ChatInput(StrictModel):
    """A conversation for the chat template (chat_prompt)."""

    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    # vLLM's: end inside the final message (its text left open), with add_generation_prompt false.
    continue_final_message: bool = False
    # vLLM's: the tokenizer's post-processor (a BOS) on the rendered text; off, as the template
    # writes the special tokens itself.
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class ChatCompletionRequest(SamplingFields, ChatInput):
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    modalities: Any = None


# Fields of OpenAI's API or vLLM's extensions that change what is generated and that this server
# does not implement: set to anything but their neutral value, a request is refused naming the
# field, never served as if the field had not been sent. (Unknown fields are still ignored.)
UNIMPLEMENTED = {
    "guided_json": lambda v: v is None,
    "guided_regex": lambda v: v is None,
    "guided_choice": lambda v: v is None,
    "guided_grammar": lambda v: v is None,
    "structured_outputs": lambda v: v is None,
    "logits_processors": lambda v: not v,
    "use_beam_search": lambda v: v is None or v is False,
    "truncation_side": lambda v: v is None or v == "left",  # vLLM's; truncate_prompt_tokens's
    "tool_choice": lambda v: v is None or v == "none",
    "functions": lambda v: not v,
    "function_call": lambda v: v is None or v == "none",
    "modalities": lambda v: v is None or v == ["text"],
}


def bad_param(param: str, message: str) -> APIError:
    """The 400 for an invalid request field, naming it."""
    return APIError(400, f"{param}: {message}", param)


def shown(value: Any, limit: int = 80) -> str:
    """`repr(value)` for an error message, cut to `limit` characters: a client's 1 MB role name or
    stop list is not sent back whole."""
    r = repr(value)
    return r if len(r) <= limit else f"{r[:limit]}... ({len(r)} characters)"


def _check_neutral(req: SamplingFields) -> None:
    if req.best_of is not None and req.best_of != req.n:
        raise bad_param("best_of", "only best_of = n is supported")
    for field, neutral in UNIMPLEMENTED.items():
        value = getattr(req, field, None)
        if not neutral(value):
            raise bad_param(field, f"{shown(value)} is not supported by this server")


def logit_bias(req: SamplingFields) -> dict[int, float]:
    """`logit_bias` with int keys; raises APIError(400) naming a key that is not a token id
    (OpenAI's keys are token ids written as strings). The vocabulary bound is
    `jaxinfer.requests.check_sampling`'s, a 400 naming `logit_bias` too."""
    out = {}
    for key, bias in (req.logit_bias or {}).items():
        if not re.fullmatch(r"\d{1,10}", key.strip()):
            raise bad_param("logit_bias", f"key {shown(key)} is not a token id (an int >= 0)")
        out[int(key)] = bias
    return out


def stop_strings(req: SamplingFields) -> list[str]:
    stop = [] if req.stop is None else [req.stop] if isinstance(req.stop, str) else req.stop
    if any(s == "" for s in stop):
        raise bad_param("stop", "stop strings must be non-empty")
    return list(stop)


def text_options(
    req: SamplingFields, stop_token_ids: tuple[int, ...], min_tokens: int
) -> TextOptions:
    """How the request's token ids become text (vLLM's defaults where a field is absent)."""
    return TextOptions(
        stops=tuple(stop_strings(req)),
        stop_token_ids=frozenset(stop_token_ids),
        min_tokens=min_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output is True,
        skip_special_tokens=req.skip_special_tokens is not False,
        spaces_between_special_tokens=req.spaces_between_special_tokens is not False,
    )


def truncation(req: SamplingFields, max_model_len: int, max_tokens: int | None) -> int | None:
    """How many last prompt tokens `truncate_prompt_tokens` keeps (None: all), as vLLM: -1 is
    the context left for max_tokens, any k >= 1 at most that; raises APIError(400) naming it.

    Args:
      req: the parsed request.
      max_model_len: the served context.
      max_tokens: the request's own limit (None: a chat request without one).
    """
    k = req.truncate_prompt_tokens
    if k is None:
        return None
    room = max_model_len - (max_tokens or 0)  # vLLM's max_input_tokens
    if k == -1:
        return max(room, 1)  # room < 1: max_tokens alone overflows, a 400 naming it follows
    if k < 1:
        raise bad_param("truncate_prompt_tokens", f"{k} must be -1 (all that fit) or an int >= 1")
    if k > room >= 1:
        raise bad_param(
            "truncate_prompt_tokens",
            f"{k} is more than max_model_len {max_model_len} - max_tokens {max_tokens or 0} = "
            f"{room} prompt tokens",
        )
    return k


def num_prompt_logprobs(req: SamplingFields) -> int | None:
    """vLLM's `prompt_logprobs`: None, or how many top alternatives each prompt token's entry
    holds beside the token itself; raises APIError(400) naming it. As vLLM: refused with
    stream = true unless 0 (a stream carries no prompt logprobs); -1 (the whole vocabulary) and
    k > 20 exceed its default max_logprobs of 20."""
    k = req.prompt_logprobs
    if k is None:
        return None
    if req.stream and k != 0:
        raise bad_param("prompt_logprobs", "not available when stream = true")
    if not 0 <= k <= MAX_LOGPROBS:
        raise bad_param(
            "prompt_logprobs",
            f"{k} must be in [0, {MAX_LOGPROBS}] (-1, the whole vocabulary, is more than "
            f"{MAX_LOGPROBS} too)",
        )
    return k


def sampling_params(
    req: SamplingFields,
    max_tokens: int,
    logprobs: int | None,
    max_n: int,
    bad_words: tuple[tuple[int, ...], ...] = (),
) -> SamplingParams:
    """The engine's SamplingParams of a request; raises APIError(400) naming the bad field.

    Args:
      req: the parsed request.
      max_tokens: the resolved token limit (the request's, or the default).
      logprobs: None, or how many top alternatives per token to return.
      max_n: the most parallel samples the engine runs (its max_num_seqs).
      bad_words: `bad_words_ids(req, tokenizer)`.
    """
    _check_neutral(req)
    if req.stream_options is not None and not req.stream:  # as OpenAI: not silently ignored
        raise bad_param("stream_options", "only allowed when stream is true")
    t = 1.0 if req.temperature is None else req.temperature
    if not math.isfinite(t) or not (t == 0 or t >= MIN_POSITIVE):
        raise bad_param("temperature", f"{t!r} must be 0 or a finite number >= 1e-30")
    top_p = 1.0 if req.top_p is None else req.top_p
    if not MIN_POSITIVE <= top_p <= 1:
        raise bad_param("top_p", f"{top_p!r} must be in (0, 1] (at least 1e-30)")
    top_k = 0 if req.top_k is None or req.top_k == -1 else req.top_k
    if not 0 <= top_k <= INT32_MAX:
        raise bad_param("top_k", f"{req.top_k!r} must be -1 or 0 (off) or an int in [1, 2**31 - 1]")
    min_p = 0.0 if req.min_p is None else req.min_p
    if not 0 <= min_p <= 1:
        raise bad_param("min_p", f"{min_p!r} must be in [0, 1]")
    # The engine's ints travel as int32: a larger one is a 400 here, not a 500 below.
    if not 1 <= max_tokens <= INT32_MAX:
        chat_limit = getattr(req, "max_completion_tokens", None) is not None
        field = "max_completion_tokens" if chat_limit else "max_tokens"
        raise bad_param(field, f"{max_tokens} must be in [1, 2**31 - 1]")
    if not 1 <= req.n <= max_n:
        raise bad_param("n", f"{req.n} must be in [1, {max_n}] (the engine's max_num_seqs)")
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        field = "top_logprobs" if isinstance(req, ChatCompletionRequest) else "logprobs"
        raise bad_param(field, f"{logprobs} must be in [0, {MAX_LOGPROBS}]")
    allowed = req.allowed_token_ids
    if allowed is not None and (not allowed or min(allowed) < 0):
        raise bad_param(
            "allowed_token_ids",
            f"{min(allowed)}: token ids must be >= 0" if allowed else "must not be empty",
        )
    stops = req.stop_token_ids or []
    if any(not 0 <= s <= INT32_MAX for s in stops):
        bad = next(s for s in stops if not 0 <= s <= INT32_MAX)
        raise bad_param("stop_token_ids", f"{bad}: token ids must be in [0, 2**31 - 1]")
    # OpenAI seeds are any int; the engine's keys take [0, 2**31). No seed: a fresh one.
    seed = random.randrange(2**31) if req.seed is None else req.seed % 2**31
    try:
        return SamplingParams(
            temperature=float(t),
            top_k=int(top_k),
            top_p=float(top_p),
            min_p=float(min_p),
            max_tokens=int(max_tokens),
            stop_token_ids=tuple(stops),
            seed=seed,
            ignore_eos=req.ignore_eos,
            n=req.n,
            logprobs=logprobs,
            presence_penalty=0.0 if req.presence_penalty is None else req.presence_penalty,
            frequency_penalty=0.0 if req.frequency_penalty is None else req.frequency_penalty,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=logit_bias(req),
            min_tokens=0 if req.min_tokens is None else req.min_tokens,
            allowed_token_ids=req.allowed_token_ids,
            bad_words_ids=bad_words,
        )
    except ValueError as e:  # a bound checked only there: still a 400, not a 500
        match = re.match(r"SamplingParams\.(\w+)=", str(e))
        field, message = match.group(1) if match else "sampling", str(e)
        if field == "bad_words_ids":  # the request's field, without all its sequences echoed
            field = "bad_words"
            message = "its token sequences: " + message.split(" is invalid: ", 1)[-1]
        raise bad_param(field, message) from None


def completion_logprobs(req: CompletionRequest) -> int | None:
    return req.logprobs


def chat_logprobs(req: ChatCompletionRequest) -> int | None:
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_param("top_logprobs", "requires logprobs = true")
    if not req.logprobs:
        return None
    return 0 if req.top_logprobs is None else req.top_logprobs


def _content_text(param: str, parts: list) -> str:
    """The text of a list of content parts, one line each; only text parts are taken."""
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict):
            raise bad_param(
                param, f"part {j} is {type(part).__name__}, expected a content part object"
            )
        if part.get("type") != "text":
            raise bad_param(
                param,
                f"part {j} has type {shown(part.get('type'))}; this server takes only 'text' parts",
            )
        if not isinstance(part.get("text"), str):
            raise bad_param(param, f"part {j}: a 'text' part needs a string 'text'")
        texts.append(part["text"])
    return "\n".join(texts)  # as vLLM joins a message's text parts


def chat_messages(req: ChatInput) -> list[dict]:
    """The messages as template input (text parts joined); raises APIError(400) naming
    `messages.i.role` or `messages.i.content`."""
    messages = []
    for i, m in enumerate(req.messages):
        if m.role not in CHAT_ROLES:
            raise bad_param(
                f"messages.{i}.role", f"{shown(m.role)} is not one of {', '.join(CHAT_ROLES)}"
            )
        if m.content is None and m.role not in _NULL_CONTENT_ROLES:
            raise bad_param(
                f"messages.{i}.content",
                f"a {shown(m.role)} message needs content (a string or a list of text parts)",
            )
        if isinstance(m.content, list) and not m.content:  # as OpenAI answers
            raise bad_param(f"messages.{i}.content", "an empty list of content parts")
        d = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):
            d["content"] = _content_text(f"messages.{i}.content", m.content)
        messages.append(d)
    return messages


def chat_prompt(req: ChatInput, tokenizer: Any, chat_template: str | None) -> str:
    """The request's conversation rendered by the chat template; raises APIError(400) naming
    `messages` (or one message's field, see chat_messages), `chat_template_kwargs` or
    `continue_final_message`.

    A failure is the kwargs' when the conversation renders without them (a variable of the wrong
    type, a value the template refuses, `documents` that are not a list); else it is
    continue_final_message's when the conversation renders without that (a final message without
    content, a template that rewrites it, add_generation_prompt true as by default: vLLM refuses
    both, and transformers' renderer refuses them where vLLM's default lets them through);
    otherwise it is the messages' (the template refuses them with its own defaults).

    Args:
      req: the parsed request.
      tokenizer: the served tokenizer (its special tokens are template variables).
      chat_template: a template overriding the tokenizer's, or None.
    """
    messages = chat_messages(req)
    kwargs = req.chat_template_kwargs or {}
    taken = sorted(set(kwargs) & _TEMPLATE_ARGS)
    if taken:
        raise bad_param(
            "chat_template_kwargs", f"{taken} cannot be set here (messages, "
            "add_generation_prompt and continue_final_message are request fields; the template "
            "is the server's)",
        )  # fmt: skip
    if kwargs.get("tools"):  # the `tools` field is refused: not through the back door either
        raise bad_param("chat_template_kwargs.tools", "tools are not supported by this server")
    cont = req.continue_final_message  # with add_generation_prompt, refused by the renderer

    def render(kw: dict, continued: bool) -> str:
        return apply_chat_template(
            tokenizer, messages, req.add_generation_prompt, chat_template=chat_template,
            continue_final_message=continued, **kw,
        )  # fmt: skip

    try:
        return render(kwargs, cont)
    except ValueError as e:  # ChatTemplateError included
        param = "messages"
        retries = [("chat_template_kwargs", cont)] if kwargs else []
        retries += [("continue_final_message", False)] if cont else []
        for blame, continued in retries:  # each without the kwargs
            try:
                render({}, continued)
            except ValueError:
                continue
            param = blame
            break
        message = str(e).removeprefix(f"{param}: ")
        if param == "continue_final_message" and req.add_generation_prompt:
            message += " (add_generation_prompt is true unless sent false)"
        raise bad_param(param, message) from None


def parse_body(body: bytes, model: type[BaseModel]):
    """A request body as `model`; raises APIError(400) naming the first bad field."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise validation_error(e.errors()) from None


def validation_error(errors: list[dict]) -> APIError:
    """A 400 from pydantic's errors, naming the first bad field (`messages.0.content`)."""
    e = errors[0]
    loc = [str(x) for x in e.get("loc", ()) if not str(x).startswith(("function-", "list["))]
    # Union members add their type to the location (prompt.str, prompt.list[int]); drop them.
    loc = [x for x in loc if x not in ("str", "int", "float", "bool")]
    param = ".".join(loc) or None
    if e.get("type") == "json_invalid":
        return APIError(400, f"malformed JSON body: {e.get('msg')}", None)
    msg = e.get("msg", "invalid value")
    return APIError(400, f"{param}: {msg}" if param else msg, param)
