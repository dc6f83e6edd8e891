"""`SpeculativeConfig`: speculative decoding inside the serving engine (`ji.EngineConfig`).

    ji.EngineConfig(speculative=ji.SpeculativeConfig(drafter="ngram", num_speculative_tokens=3))
    ji.EngineConfig(speculative=ji.SpeculativeConfig(drafter=(dcfg, dparams),
                                                     num_speculative_tokens="auto", max_gamma=6))
    ji.EngineConfig(speculative=ji.SpeculativeConfig(drafter=ji.speculative.heads.load_head(
        ji.models.path("smollm2-135m-eagle"), cfg), num_speculative_tokens=3))

The engine and the standalone loop (`ji.speculative.generate`) share the drafters
(`drafters.py`: n-gram prompt lookup, a draft model; `heads/`: Medusa and EAGLE-style heads) and
the acceptance functions (`acceptance.py`); see `jaxinfer/engine/speculation.py` for the engine's
step and `jaxinfer/engine/head_drafting.py` for the heads in it.
"""

from __future__ import annotations

import dataclasses

from jaxinfer.checks import check_int
from jaxinfer.config import ModelConfig
from jaxinfer.speculative.heads.config import Head, HeadConfig, check_pairing

DRAFTERS = ("ngram", "model", "head")  # by name; a model as (dcfg, dparams), a head as a Head
_HELP = "'ngram', (ModelConfig, params) or a ji.speculative.heads.Head"
ACCEPTANCE = ("rejection", "coupled")


@dataclasses.dataclass(frozen=True, eq=False)
class SpeculativeConfig:
    """Speculative decoding in the engine.

    Attributes:
      drafter: "ngram" (prompt lookup, no model), `(dcfg, dparams)`, a draft model sharing the
        target's vocabulary (its own paged KV cache on the target's block tables), or a
        `ji.speculative.heads.Head` trained for the target (Medusa, EAGLE-style: they read the
        target's features, which the engine keeps by slot beside its KV cache); a head with
        `ngram_first` is the hybrid drafter (n-gram proposals where the suffix recurs).
      num_speculative_tokens: γ, drafted tokens per decoding request per step, in 0..max_gamma
        (0 is plain decoding); "auto": the controller picks γ every step for the batch.
      acceptance: "rejection" (exact in distribution) or "coupled" (token-identical to plain
        sampling with the same seeds: drafter and target share per-position Gumbel noise).
        Temperature-0 rows are greedy in both.
      max_gamma: the largest γ; None: num_speculative_tokens if it is an int, else 4. Fixes the
        draft's compiled length, so one program serves every γ of a run.
      ngram_max: the n-gram drafter's longest suffix match (also the hybrid head's).
    """

    drafter: str | tuple = "ngram"
    num_speculative_tokens: int | str = 3
    acceptance: str = "rejection"
    max_gamma: int | None = None
    ngram_max: int = 3

    def __post_init__(self):
        d = self.drafter
        if isinstance(d, str):
            if d == "model":
                raise ValueError(
                    "SpeculativeConfig.drafter='model' needs a model: pass (dcfg, dparams)"
                )
            if d != "ngram":
                raise ValueError(f"SpeculativeConfig.drafter={d!r}: expected {_HELP}")
        elif isinstance(d, Head):
            if not isinstance(d.cfg, HeadConfig):
                raise ValueError(
                    f"SpeculativeConfig.drafter: Head.cfg is {type(d.cfg).__name__}, expected a "
                    "HeadConfig"
                )
        elif not (isinstance(d, tuple) and len(d) == 2 and isinstance(d[0], ModelConfig)):
            raise ValueError(f"SpeculativeConfig.drafter={type(d).__name__}: expected {_HELP}")
        if self.acceptance not in ACCEPTANCE:
            raise ValueError(
                f"SpeculativeConfig.acceptance={self.acceptance!r}: expected one of {ACCEPTANCE}"
            )
        n = self.num_speculative_tokens
        auto = n == "auto"
        if not auto:
            if isinstance(n, str):
                raise ValueError(
                    f"SpeculativeConfig.num_speculative_tokens={n!r}: expected an int or 'auto'"
                )
            n = check_int("SpeculativeConfig.num_speculative_tokens", n, 0)
            object.__setattr__(self, "num_speculative_tokens", n)
        g = self.max_gamma
        if g is None:
            g = 4 if auto else max(n, 1)
        g = check_int("SpeculativeConfig.max_gamma", g, 1)
        object.__setattr__(self, "max_gamma", g)
        if not auto and n > g:
            raise ValueError(f"SpeculativeConfig.num_speculative_tokens={n} is above max_gamma={g}")
        head = self.draft_head
        if head is not None and head.cfg.kind == "medusa" and g > head.cfg.num_medusa_heads:
            raise ValueError(
                f"SpeculativeConfig.max_gamma={g} exceeds the medusa head's num_medusa_heads="
                f"{head.cfg.num_medusa_heads}: each head drafts one position"
            )
        object.__setattr__(
            self, "ngram_max", check_int("SpeculativeConfig.ngram_max", self.ngram_max, 1)
        )
        if head is not None and head.ngram_first > self.ngram_max:
            raise ValueError(
                f"SpeculativeConfig.drafter: the head's ngram_first={head.ngram_first} exceeds "
                f"ngram_max={self.ngram_max}"
            )

    @property
    def auto(self) -> bool:
        return self.num_speculative_tokens == "auto"

    @property
    def draft_model(self) -> tuple | None:
        """(dcfg, dparams) of the model drafter; None for n-gram and heads."""
        return self.drafter if isinstance(self.drafter, tuple) else None

    @property
    def draft_head(self) -> Head | None:
        """The head drafter; None for n-gram and draft models."""
        return self.drafter if isinstance(self.drafter, Head) else None

    def check_target(self, cfg: ModelConfig) -> None:
        """Raises ValueError if the drafter cannot serve the target `cfg`."""
        if self.draft_head is not None:
            check_pairing(self.draft_head.cfg, cfg)  # names each field of another target
        dm = self.draft_model
        if dm is not None and dm[0].vocab_size != cfg.vocab_size:
            raise ValueError(
                f"SpeculativeConfig.drafter: the draft model's vocabulary ({dm[0].vocab_size} "
                f"tokens) differs from the target's ({cfg.vocab_size}); drafter and target "
                "must share a tokenizer"
            )
