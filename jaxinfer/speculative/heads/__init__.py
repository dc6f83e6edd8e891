"""Learned drafter heads on the target's own features: Medusa (`medusa.py`, K residual heads, no
cache) and an EAGLE-style feature drafter (`eagle.py`, one decoder layer with its own paged
cache). Each is a pure function over its own param pytree; `config.py` holds the config, the
`Head` pair, pairing checks and save / load; `lm.py` the frozen target head with an optional
draft vocabulary; `drafter.py` the prefill / draft / observe functions the loop calls.

    head = ji.speculative.heads.Head(hcfg, params)   # or heads.load_head(path, target_cfg)
    ji.speculative.generate(target=(cfg, params), draft=head, prompts=..., gamma=4)
"""

from jaxinfer.speculative.heads.config import (
    HEAD_KINDS,
    Head,
    HeadConfig,
    check_pairing,
    head_config_for,
    load_head,
    save_head,
)
from jaxinfer.speculative.heads.drafter import (
    HeadState,
    head_draft,
    head_observe,
    head_prefill,
    unpack_draft,
)
from jaxinfer.speculative.heads.eagle import (
    draft_eagle,
    eagle_dense,
    eagle_paged,
    fuse_features,
    init_eagle,
)
from jaxinfer.speculative.heads.lm import feature_logits, pair
from jaxinfer.speculative.heads.medusa import (
    draft_medusa,
    init_medusa,
    medusa_features,
    medusa_logits,
)

__all__ = [
    "HEAD_KINDS",
    "Head",
    "HeadConfig",
    "HeadState",
    "check_pairing",
    "draft_eagle",
    "draft_medusa",
    "eagle_dense",
    "eagle_paged",
    "feature_logits",
    "fuse_features",
    "head_config_for",
    "head_draft",
    "head_observe",
    "head_prefill",
    "init_eagle",
    "init_medusa",
    "load_head",
    "medusa_features",
    "medusa_logits",
    "pair",
    "save_head",
    "unpack_draft",
]
