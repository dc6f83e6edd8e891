"""GGUF tokenizers: the `tokenizers` pipeline of a GGUF file's `tokenizer.ggml.*` metadata.

A GGUF file carries no tokenizer.json: llama.cpp stores the vocabulary as metadata
(`tokenizer.ggml.*`). This module rebuilds the `tokenizers` pipeline that transformers builds from
the same metadata (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`), so both give the same ids:

- `gpt2`: byte-level BPE. Tokens are respelled in the GPT-2 byte alphabet where they are not
  already; merges come from `tokenizer.ggml.merges`; the split regex is chosen by
  `tokenizer.ggml.pre` (GPT-2's own for names transformers does not map, e.g. SmolLM2's `smollm`).
- `llama`: SentencePiece-style BPE with byte fallback (`<0x41>` tokens). Merges are the file's or,
  as usual, recovered from the vocabulary ranked by `tokenizer.ggml.scores`; spaces become `▁`
  and one `▁` is prepended to the text (transformers' non-legacy Metaspace; a normalizer for
  Phi-3). transformers ignores `tokenizer.ggml.add_space_prefix`, and so does this module, to
  stay id-identical. Gemma files, which need another recipe, are refused by name.

Token types (llama.cpp's `llama_token_type`) decide added tokens: CONTROL (3) tokens become special
tokens, USER_DEFINED (4) ones plain added tokens, both matched whole in the text. The bos/eos/unk/
pad ids become named special tokens; `tokenizer.ggml.add_bos_token` / `add_eos_token` become a
post-processor (a `llama` vocabulary adds bos unless the file says otherwise, as llama.cpp does).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)
from tokenizers import Tokenizer as BackendTokenizer

# llama.cpp's token types (`tokenizer.ggml.token_type`).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# Named special token -> GGUF metadata key of its id.
_SPECIAL_ID_KEYS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}

# Split regexes by `tokenizer.ggml.pre`, the ones transformers maps. Any other name keeps GPT-2's
# regex (the ByteLevel pre-tokenizer's own), as transformers does.
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_GPT4O = (
    rf"[^\r\n\p{{L}}\p{{N}}]?[\p{{Lu}}\p{{Lt}}\p{{Lm}}\p{{Lo}}\p{{M}}]*[\p{{Ll}}\p{{Lm}}\p{{Lo}}\p{{M}}]+"
    rf"{_CONTRACTION}"
    rf"|[^\r\n\p{{L}}\p{{N}}]?[\p{{Lu}}\p{{Lt}}\p{{Lm}}\p{{Lo}}\p{{M}}]+[\p{{Ll}}\p{{Lm}}\p{{Lo}}\p{{M}}]*"
    rf"{_CONTRACTION}"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2")
        + ("jina-v5-nano", "dbrx", "smaug-bpe"),
        _LLAMA3,
    ),
    "tekken": _TEKKEN,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2),
    "qwen35": _QWEN35,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O),
}

# general.architecture values whose `llama` vocabulary transformers builds another way.
_UNSUPPORTED_SENTENCEPIECE_ARCHS = ("gemma", "gemma2", "gemma3")


def _read_gguf_fields(path: str) -> dict[str, Any]:
    """The `tokenizer.*` metadata of a GGUF file as Python values."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError, struct/numpy errors on a bad file
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from None
    fields = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.") or key == "general.architecture":
            try:
                fields[key] = field.contents()
            except Exception as e:
                raise ValueError(f"GGUF metadata {key} in {path} cannot be read: {e}") from None
    return fields


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte alphabet: each byte as a printable character (printable Latin-1 bytes map
    to themselves, the other 68 to U+0100 onwards in byte order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _merges_from_file(merges: Sequence[str], path: str) -> list[tuple[str, str]]:
    pairs = []
    for i, merge in enumerate(merges):
        parts = merge.split(" ")
        if len(parts) != 2:
            raise ValueError(
                f"GGUF metadata tokenizer.ggml.merges[{i}] in {path} is {merge!r}, expected two "
                "tokens separated by one space"
            )
        pairs.append((parts[0], parts[1]))
    return pairs


def _merges_from_scores(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """The merges a SentencePiece BPE vocabulary implies, in transformers' order.

    Every token that splits into two tokens of the vocabulary yields that pair. Pairs are ranked
    by their token's score (best first), then by the lengths of the two parts (longer left part
    first); ties keep the vocabulary order, and within one token the order of the parts' ids.
    """
    ids = {t: i for i, t in enumerate(tokens)}
    ranked = []  # (score, left, right)
    for token, score in dict(zip(tokens, scores, strict=False)).items():
        pairs = [(token[:c], token[c:]) for c in range(1, len(token))]
        pairs = [(l, r) for l, r in pairs if l in ids and r in ids]
        pairs.sort(key=lambda p: (ids[p[0]], ids[p[1]]))
        ranked.extend((score, l, r) for l, r in pairs)
    # A stable sort (reverse=True keeps the order of equal keys).
    ranked.sort(key=lambda m: (m[0], len(m[1]), len(m[2])), reverse=True)
    return [(l, r) for _, l, r in ranked]


def _require(fields: Mapping[str, Any], key: str, path: str) -> Any:
    if key not in fields:
        raise ValueError(f"GGUF file {path} has no tokenizer metadata {key}")
    return fields[key]


def gguf_tokenizer(path: str) -> dict[str, Any]:
    """Builds the tokenizer a GGUF file's `tokenizer.ggml.*` metadata describes.

    Args:
      path: a `.gguf` file.

    Returns:
      The keyword arguments of `jaxinfer.tokenizer.Tokenizer`: a `tokenizers.Tokenizer` that
      encodes as transformers' GGUF tokenizer does (`backend`), the file's chat template
      (`tokenizer.chat_template`), special tokens and bos/eos flags.
    """
    fields = _read_gguf_fields(path)
    kind = _require(fields, "tokenizer.ggml.model", path)
    tokens = list(_require(fields, "tokenizer.ggml.tokens", path))
    types = list(fields.get("tokenizer.ggml.token_type") or [])
    if types and len(types) != len(tokens):
        raise ValueError(
            f"GGUF metadata tokenizer.ggml.token_type in {path} has {len(types)} entries for "
            f"{len(tokens)} tokens"
        )
    arch = fields.get("general.architecture")
    if kind == "gpt2":
        backend = _byte_level_bpe(fields, tokens, path)
    elif kind == "llama" and arch in _UNSUPPORTED_SENTENCEPIECE_ARCHS:
        # Gemma files respell whitespace tokens and rank merges by file order: another recipe,
        # which a Llama-style build would get silently wrong.
        raise ValueError(
            f"GGUF file {path} (general.architecture = {arch!r}) has a SentencePiece vocabulary "
            "that needs Gemma's tokenizer recipe, which jaxinfer does not build"
        )
    elif kind == "llama":
        backend = _sentencepiece_bpe(fields, tokens, path, phi3=arch == "phi3")
    else:
        raise ValueError(
            f"GGUF file {path} has tokenizer model tokenizer.ggml.model = {kind!r}; jaxinfer "
            "builds 'gpt2' (byte-level BPE) and 'llama' (SentencePiece BPE)"
        )

    # Control tokens are special and whole; in a byte-level vocabulary one spelled outside the
    # byte alphabet is mislabelled (it was never a token of the merges), and is skipped as
    # transformers skips it. User-defined tokens are matched whole but not special; as in
    # transformers, only those the vocabulary holds as the file spells them. Named specials
    # below also use the file's spelling.
    alphabet = set(_bytes_to_unicode().values()) if kind == "gpt2" else None
    vocab = backend.get_vocab()
    control = [
        t for t, ty in zip(tokens, types, strict=False)
        if ty == _CONTROL and (alphabet is None or set(t) <= alphabet)
    ]  # fmt: skip
    user = [t for t, ty in zip(tokens, types, strict=False) if ty == _USER_DEFINED and t in vocab]
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])

    special: dict[str, str] = {}
    for name, key in _SPECIAL_ID_KEYS.items():
        token_id = fields.get(key)
        if token_id is None:
            continue
        if not 0 <= int(token_id) < len(tokens):
            raise ValueError(
                f"GGUF metadata {key} in {path} is {token_id}, outside the vocabulary of "
                f"{len(tokens)} tokens"
            )
        special[name] = tokens[int(token_id)]
    # Named specials are special added tokens too (an UNKNOWN-typed <unk>, a NORMAL pad), as
    # transformers adds them; a name already added keeps its flags.
    added = {a.content for a in backend.get_added_tokens_decoder().values()}
    named = [t for t in dict.fromkeys(special.values()) if t not in added]
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in named])

    add_bos = fields.get("tokenizer.ggml.add_bos_token")
    if add_bos is None and kind == "llama":
        add_bos = True  # llama.cpp's default for a SentencePiece vocabulary that does not say
    add_bos = bool(add_bos) and "bos_token" in special
    add_eos = bool(fields.get("tokenizer.ggml.add_eos_token")) and "eos_token" in special
    backend.post_processor = _bos_eos_processor(backend, special, add_bos, add_eos)
    return dict(
        backend=backend,
        chat_template=fields.get("tokenizer.chat_template"),
        special_tokens=special,
        add_bos_token=add_bos,
        add_eos_token=add_eos,
    )


def _bos_eos_processor(
    backend: BackendTokenizer, special: Mapping[str, str], add_bos: bool, add_eos: bool
) -> processors.TemplateProcessing:
    bos, eos = special.get("bos_token"), special.get("eos_token")
    a = " ".join([f"{bos}:0"] * add_bos + ["$A:0"] + [f"{eos}:0"] * add_eos)
    b = " ".join([f"{bos}:1"] * add_bos + ["$B:1"] + [f"{eos}:1"] * add_eos)
    used = [bos] * add_bos + [eos] * add_eos
    return processors.TemplateProcessing(
        single=a, pair=f"{a} {b}", special_tokens=[(t, backend.token_to_id(t)) for t in used]
    )


def _byte_level_bpe(fields: Mapping[str, Any], tokens: list[str], path: str) -> BackendTokenizer:
    """GPT-2-style BPE over bytes."""
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    # llama.cpp writes some tokens (added ones, mostly) as plain UTF-8 text; the BPE model
    # needs every token in the byte alphabet.
    respelled = [
        t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")) for t in tokens
    ]
    merges = _merges_from_file(_require(fields, "tokenizer.ggml.merges", path), path)
    vocab = {t: i for i, t in enumerate(respelled)}
    backend = BackendTokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    split = _PRE_TOKENIZER_SPLITS.get(fields.get("tokenizer.ggml.pre"))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(
    fields: Mapping[str, Any], tokens: list[str], path: str, *, phi3: bool = False
) -> BackendTokenizer:
    """SentencePiece-style BPE: `▁` for spaces, byte-fallback tokens `<0xNN>` for the rest.

    Phi-3 gets its `▁` from a normalizer (prepended to the whole text, every space replaced),
    not from a Metaspace pre-tokenizer; the two differ only on text that starts with a space.
    """
    if "tokenizer.ggml.merges" in fields:
        merges = _merges_from_file(fields["tokenizer.ggml.merges"], path)
    else:
        scores = list(_require(fields, "tokenizer.ggml.scores", path))
        if len(scores) != len(tokens):
            raise ValueError(
                f"GGUF metadata tokenizer.ggml.scores in {path} has {len(scores)} entries for "
                f"{len(tokens)} tokens"
            )
        merges = _merges_from_scores(tokens, scores)
    backend = BackendTokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(tokens)},
            merges=merges,
            fuse_unk=True,
            byte_fallback=True,
            dropout=None,
        )
    )
    if phi3:
        backend.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
        )
        backend.pre_tokenizer = None
    else:
        backend.normalizer = None
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="▁", prepend_scheme="first", split=False
        )
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(content=" ", left=1, right=0),
        ]
    )
    return backend
