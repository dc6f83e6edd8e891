r"""Memory maps held by the engine's compiled programs (Linux): what `engine/compiled.py` guards.

    python -m experiments.map_count --workdir=runs/map_count          # SmolLM2, both formats
    python -m experiments.map_count --warm_up=1,2                     # + a hybrid engine's warm_up

XLA's CPU backend maps each kernel of a compiled program on its own (code, constants, data), and
a process may hold `vm.max_map_count` maps. For each weight format, in a fresh process each: the
maps after loading and building an engine, then after each new plain step shape (one request of
64 tokens, then two: T = 1, then T = 2), the anonymous executable maps those added (one per
kernel object), the maps after `cycles.warm_up` of a hybrid-drafter engine (γ auto, max 4) at
--warm_up's batch sizes (and its seconds), and after `compiled.clear()`.
"""

from __future__ import annotations

import json
import subprocess
import sys

from absl import app, flags

from experiments import common, flag_checks

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "A ji.models name or a path.")
_HEAD = flags.DEFINE_string("head", "smollm2-135m-eagle", "The hybrid's head (--warm_up).")
_FORMATS = flags.DEFINE_list("formats", ["gguf-as-stored", "float32"], "Weight formats.")
_WARM_UP = flags.DEFINE_list("warm_up", [], "Batch sizes of a hybrid engine's warm_up; none: skip.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Where config.json and results.json go.")
_CONFIG = common.config_flag()
flag_checks.choice_list(_FORMATS, ("gguf-as-stored", "float32"))
flag_checks.int_list(_WARM_UP, min_value=1, allow_empty=True)

_CHILD = """
import dataclasses, json, sys, time
import jaxinfer as ji
from jaxinfer.engine import compiled
from jaxinfer.engine.cycles import warm_up

def maps():
    lines = open("/proc/self/maps").read().splitlines()
    code = sum(1 for l in lines if " r-xp " in l and len(l.split()) < 6)  # anonymous code
    return len(lines), code

path, fmt, head, sizes = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
cfg, params = ji.load_checkpoint(path, keep_quantized=fmt == "gguf-as-stored")
ecfg = ji.EngineConfig(num_blocks=64)
engine = ji.Engine(cfg, params, ecfg)
out = {"limit": compiled.map_limit(), "engine": maps()}
sp = ji.SamplingParams(temperature=0, max_tokens=2)
for b in (1, 2):
    engine.generate([[5 + i] * 64 for i in range(b)], sp)
    out[f"plain T={b}"] = maps()
if sizes:
    drafter = ji.speculative.heads.load_head(head, cfg)
    spec = ji.SpeculativeConfig(drafter=dataclasses.replace(drafter, ngram_first=2),
                                num_speculative_tokens="auto", max_gamma=4)
    eng = ji.Engine(cfg, params, dataclasses.replace(ecfg, speculative=spec))
    t0 = time.perf_counter()
    warm_up(eng, batch_sizes=sizes)
    out["warm_up"], out["warm_up_s"] = maps(), time.perf_counter() - t0
compiled.clear()
out["cleared"] = maps()
print(json.dumps(out))
"""


def main(argv):
    del argv
    common.apply_config(_CONFIG.value)
    path = common.resolve_model(_MODEL.value)
    head = common.resolve_model(_HEAD.value) if _WARM_UP.value else ""
    if _WORKDIR.value:
        common.save_config(_WORKDIR.value, resolved={"model": path})
    sizes = json.dumps([int(b) for b in _WARM_UP.value])
    results = {}
    for fmt in _FORMATS.value:
        out = subprocess.run(
            [sys.executable, "-c", _CHILD, path, fmt, head, sizes],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        row = json.loads(out.strip().splitlines()[-1])
        results[fmt] = row
        print(f"\n{fmt} (vm.max_map_count {row['limit']}):")
        prev = row["engine"]
        print(f"  engine built: {prev[0]} maps")
        for key in [k for k in row if k.startswith("plain") or k in ("warm_up", "cleared")]:
            n, code = row[key]
            extra = f", {row['warm_up_s']:.0f} s" if key == "warm_up" else ""
            print(f"  {key}: {n} maps ({n - prev[0]:+d}; executable {code - prev[1]:+d}){extra}")
            prev = row[key]
    if _WORKDIR.value:
        common.write_results(_WORKDIR.value, {"model": _MODEL.value, "formats": results})


if __name__ == "__main__":
    app.run(main)
