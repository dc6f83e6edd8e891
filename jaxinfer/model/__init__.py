"""The pure Llama-family decoder.

Axis glossary, used in every shape comment of the project:

  B  sequences in a batch             T  tokens in a flat (ragged) batch
  S  block size (tokens per KV block)  M  blocks per block table
  L  layers                            E  hidden size
  H  query heads                       K  kv heads (H % K == 0)
  D  head dim                          F  MLP intermediate size
  V  vocabulary                        G  quantization group size
  N  rows whose logits are returned    C  context length (M * S)
"""

from jaxinfer.model.decoder import forward, forward_dense
from jaxinfer.model.params import cpu_layout, inference_layout, init_params, param_shapes

__all__ = [
    "cpu_layout",
    "forward",
    "forward_dense",
    "inference_layout",
    "init_params",
    "param_shapes",
]
