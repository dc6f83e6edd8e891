"""GGUF checkpoints (llama.cpp's format): `load_gguf` maps a file to (ModelConfig, params).

`loader` reads the metadata and tensors (dequantized by the `gguf` library's reference);
`blocks` maps Q4_0 / Q4_1 / Q8_0 blocks onto jaxinfer's int4 / int8 weights as stored.
`jaxinfer.load_checkpoint` dispatches here for a `.gguf` file or a directory holding one.
"""

from jaxinfer.gguf.loader import (
    ARCHITECTURES,
    config_from_gguf,
    dequantize_tensor,
    find_gguf,
    load_gguf,
    open_gguf,
    unpermute_rows,
)

__all__ = [
    "ARCHITECTURES",
    "config_from_gguf",
    "dequantize_tensor",
    "find_gguf",
    "load_gguf",
    "open_gguf",
    "unpermute_rows",
]
