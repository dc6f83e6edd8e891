"""Tokenizers from HF directories, tokenizer.json files and GGUF files, with their chat templates.

    tok = ji.load_tokenizer(path)          # HF dir, tokenizer.json, model.gguf, or a dir with one
    tok.encode("Hello").ids                # every `tokenizers.Tokenizer` method, delegated
    tok.chat_template, tok.special_tokens  # what `ji.apply_chat_template` renders with
    tok.save_pretrained(out_dir)           # tokenizer.json + tokenizer_config.json for transformers

A GGUF file carries no tokenizer.json; `jaxinfer.tokenizer_gguf` rebuilds its pipeline from the
file's `tokenizer.ggml.*` metadata (`from_gguf`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer

from jaxinfer.tokenizer_gguf import gguf_tokenizer

# The named special tokens transformers keeps (`special_tokens_map`) and passes to templates.
_HF_SPECIAL_NAMES = (
    *("bos_token", "eos_token", "unk_token", "pad_token"),
    *("sep_token", "cls_token", "mask_token"),
)

_CONFIG_FILE = "tokenizer_config.json"
_TEMPLATE_FILE = "chat_template.jinja"  # where transformers >= 4.5x saves the template


# ---------------------------------------------------------------------------------------------
# The wrapper
# ---------------------------------------------------------------------------------------------


class Tokenizer:
    """A `tokenizers.Tokenizer` (`.backend`) with the chat template and named special tokens.

    Every attribute not defined here is the backend's (`encode`, `decode`, `token_to_id`,
    `get_vocab_size`, `save`, ...), so code written for a plain `tokenizers.Tokenizer` keeps
    working.
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        chat_template: str | None = None,
        special_tokens: Mapping[str, str] | None = None,
        add_bos_token: bool | None = None,
        add_eos_token: bool | None = None,
    ):
        """Args:
        backend: the `tokenizers.Tokenizer`.
        chat_template: the jinja chat template, if the model has one.
        special_tokens: {"bos_token": "<s>", ...}, the named ones that are known.
        add_bos_token / add_eos_token: whether the backend's post-processor adds them (recorded
          in tokenizer_config.json; None when unknown).
        """
        if not isinstance(backend, BackendTokenizer):
            raise ValueError(
                f"backend must be a tokenizers.Tokenizer, got {type(backend).__name__}"
            )
        self.backend = backend
        self.chat_template = chat_template
        self.special_tokens: dict[str, str] = {k: v for k, v in (special_tokens or {}).items() if v}
        self.add_bos_token = add_bos_token
        self.add_eos_token = add_eos_token

    def __getattr__(self, name: str) -> Any:
        # Only called for names not found on self; "backend" itself missing means a half-built
        # object (unpickling), where delegating would recurse.
        if name == "backend":
            raise AttributeError(name)
        return getattr(self.backend, name)

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab={self.backend.get_vocab_size()}, "
            f"special_tokens={self.special_tokens}, "
            f"chat_template={'yes' if self.chat_template else 'no'})"
        )

    def _special_id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self.backend.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def unk_token_id(self) -> int | None:
        return self._special_id("unk_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    def save_pretrained(self, path: str) -> None:
        """Writes tokenizer.json and tokenizer_config.json (special tokens, chat template).

        `transformers.AutoTokenizer.from_pretrained(path)` loads the result, template included;
        so does `ji.load_tokenizer(path)`.
        """
        os.makedirs(path, exist_ok=True)
        self.backend.save(os.path.join(path, "tokenizer.json"))
        config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
        config.update(self.special_tokens)
        if self.add_bos_token is not None:
            config["add_bos_token"] = self.add_bos_token
        if self.add_eos_token is not None:
            config["add_eos_token"] = self.add_eos_token
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        with open(os.path.join(path, _CONFIG_FILE), "w") as f:
            json.dump(config, f, indent=2, ensure_ascii=False)
        # A stale template file from an earlier save would override the config's template.
        stale = os.path.join(path, _TEMPLATE_FILE)
        if os.path.exists(stale):
            os.remove(stale)


def save_tokenizer(tokenizer: Tokenizer | BackendTokenizer, path: str) -> None:
    """Writes a tokenizer into the directory `path` as transformers expects (`save_checkpoint`).

    A `Tokenizer` writes tokenizer.json and tokenizer_config.json; a plain `tokenizers.Tokenizer`
    (no template, no named specials) writes tokenizer.json only, exactly as before.
    """
    if isinstance(tokenizer, Tokenizer):
        tokenizer.save_pretrained(path)
    elif isinstance(tokenizer, BackendTokenizer):
        os.makedirs(path, exist_ok=True)
        tokenizer.save(os.path.join(path, "tokenizer.json"))
    else:
        raise ValueError(
            "tokenizer must be a jaxinfer Tokenizer or a tokenizers.Tokenizer, got "
            f"{type(tokenizer).__name__}"
        )


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Loads a tokenizer with its chat template and special tokens.

    Args:
      path: an HF directory (tokenizer.json, and tokenizer_config.json if present), a
        tokenizer.json file, a `.gguf` file, or a directory holding one `.gguf` file and no
        tokenizer.json.

    Returns:
      A `Tokenizer`. Raises ValueError naming the file for a missing or corrupt tokenizer.json,
      and naming the key for missing GGUF tokenizer metadata or an unknown tokenizer model.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        file = os.path.join(path, "tokenizer.json")
        if os.path.isfile(file):
            return _from_hf(file, path)
        ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if len(ggufs) == 1:
            return from_gguf(os.path.join(path, ggufs[0]))
        if len(ggufs) > 1:
            raise ValueError(
                f"no tokenizer.json in {path} and several .gguf files ({', '.join(ggufs)}); "
                "pass the one to use"
            )
        raise ValueError(f"no tokenizer.json (and no .gguf file) in {path}")
    if path.endswith(".gguf"):
        if not os.path.isfile(path):
            raise ValueError(f"no GGUF file at {path}")
        return from_gguf(path)
    if not os.path.isfile(path):
        raise ValueError(f"no tokenizer.json at {path}")
    return _from_hf(path, os.path.dirname(path))


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json spells it: a string or a serialized AddedToken."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _from_hf(file: str, folder: str) -> Tokenizer:
    try:
        backend = BackendTokenizer.from_file(file)
    except Exception as e:  # tokenizers raises a bare Exception for malformed JSON
        raise ValueError(f"{file} is not a valid tokenizer.json: {e}") from None
    config: dict[str, Any] = {}
    config_file = os.path.join(folder, _CONFIG_FILE)
    if os.path.isfile(config_file):
        try:
            with open(config_file, encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"{config_file} is not valid JSON: {e}") from None
        if not isinstance(config, dict):
            raise ValueError(f"{config_file} holds {type(config).__name__}, expected an object")
    special = {
        name: token
        for name in _HF_SPECIAL_NAMES
        if (token := _token_content(config.get(name))) is not None
    }
    if not special:
        special = _specials_from_model_config(folder, backend)
    template = _chat_template(config, folder)
    return Tokenizer(
        backend,
        chat_template=template,
        special_tokens=special,
        add_bos_token=config.get("add_bos_token"),
        add_eos_token=config.get("add_eos_token"),
    )


def _chat_template(config: Mapping, folder: str) -> str | None:
    """The default template: chat_template.jinja, else tokenizer_config.json's chat_template
    (a string, or the older list of {"name", "template"} whose "default" entry is used)."""
    jinja = os.path.join(folder, _TEMPLATE_FILE)
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read()
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _specials_from_model_config(folder: str, backend: BackendTokenizer) -> dict[str, str]:
    """bos/eos named by config.json's token ids, for directories without tokenizer_config.json
    (the tiny models shipped with jaxinfer)."""
    file = os.path.join(folder, "config.json")
    if not os.path.isfile(file):
        return {}
    try:
        with open(file, encoding="utf-8") as f:
            hf = json.load(f)
    except (OSError, ValueError):
        return {}  # load_checkpoint reports a broken config.json; the tokenizer does not need it
    special = {}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id")):
        token_id = hf.get(key) if isinstance(hf, dict) else None
        if isinstance(token_id, int) and (token := backend.id_to_token(token_id)) is not None:
            special[name] = token
    return special


def from_gguf(path: str) -> Tokenizer:
    """Builds the tokenizer a GGUF file's `tokenizer.ggml.*` metadata describes.

    Args:
      path: a `.gguf` file.

    Returns:
      A `Tokenizer` that encodes as transformers' GGUF tokenizer does, with the file's chat
      template (`tokenizer.chat_template`) and special tokens (see `jaxinfer.tokenizer_gguf`).
    """
    return Tokenizer(**gguf_tokenizer(path))
