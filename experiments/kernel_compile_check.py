r"""Compile every Pallas kernel configuration for an NVIDIA GPU, on a machine without one.

    pip install "jax-cuda12-plugin==$(python -c 'import jax; print(jax.__version__)')" \
        "jax-cuda12-pjrt==$(python -c 'import jax; print(jax.__version__)')" \
        nvidia-cuda-nvcc-cu12 nvidia-cuda-nvdisasm
    python -m experiments.kernel_compile_check --workdir=/tmp/kcc

Interpret mode (the tests) proves what a kernel computes; it says nothing about whether Triton can
compile it or what the compiled kernel costs. This script answers that much without a GPU, for
every kernel `experiments/kernel_bench.py` times, its correctness grid, and the model's own calls:

1. Lowers each op for the "cuda" platform and captures the Triton module of every `pallas_call`.
2. Compiles each module to PTX for `--arch` (default 9.0: H100 / H200) with the CUDA plugin's
   Triton pipeline, the one jax itself uses when it compiles for a GPU. Records shared memory.
3. Assembles the PTX with `ptxas -v` (registers, spills, stack) and disassembles the cubin with
   `nvdisasm`: the instruction mix (tensor-core MMAs, global-load widths, local-memory traffic).

Checks: every kernel compiles; shared memory fits a block (227 KiB on sm_90); no register spills.
It exits 1 if one fails. It does not time anything: `experiments/kernel_bench.py` on a GPU does.
ptxas and nvdisasm are optional (found on PATH or in the nvidia-* wheels); without them the
report stops at step 2.

Uses two jax internals, which may move between versions: `jax._src.lib.triton.compile` (the
plugin's compilation handler) and, for jaxlib <= 0.10.2 where Triton compiles inside XLA, the
`__gpu$xla.gpu.triton` custom call that carries the module (read by wrapping `mlir.custom_call`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no CUDA runtime is needed here

import jax
import jax.numpy as jnp
from absl import app, flags
from jax._src.interpreters import mlir
from jax._src.lib import triton
from jax._src.pallas.triton import pallas_call_registration

from experiments import common, kernel_bench
from pallas_kernels.int4_matmul import int4_matmul
from pallas_kernels.int8_matmul import int8_int8_matmul, int8_matmul
from pallas_kernels.paged_attention import ragged_paged_attention

# The bench's own flags: --workdir, and --int4_m / --contexts / --batches choose what is compiled.
_ARCH = flags.DEFINE_string("arch", "9.0", "Compute capability to compile for.")
flags.register_validator(
    "arch",
    lambda v: re.fullmatch(r"\d+\.\d+", v or "") is not None,
    "--arch must be a compute capability MAJOR.MINOR, e.g. 9.0 or 8.6",
)
_SMEM_LIMIT = flags.DEFINE_integer(
    "smem_limit", 227 * 1024, "Shared memory a block may use.", lower_bound=1
)
_MODEL = flags.DEFINE_bool("model", True, "Also compile the shipped model's kernel calls.")

HEADS, KV_HEADS, HEAD_DIM, BLOCK = (
    kernel_bench.ATTN_HEADS,
    kernel_bench.ATTN_KV_HEADS,
    kernel_bench.ATTN_HEAD_DIM,
    kernel_bench.ATTN_BLOCK,
)


def _spec(shape, dtype):
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))


# ----------------------------------------------------------------------------- cases


def int4_case(m, k, n, g=128, dtype="bfloat16", perm=False):
    args = [
        _spec((m, k), dtype),
        _spec((k // 8, n), "uint32"),
        _spec((k // g, n), dtype),
        _spec((k // g, n), "int32"),
    ]
    if perm:
        args.append(_spec((k,), "int32"))
        return lambda x, p, s, z, pm: int4_matmul(x, p, s, z, group_size=g, perm=pm), args
    return lambda x, p, s, z: int4_matmul(x, p, s, z, group_size=g), args


def int8_case(m, k, n, w8a8=False):
    w = [_spec((k, n), "int8"), _spec((n,), "float32")]
    if w8a8:
        return int8_int8_matmul, [_spec((m, k), "int8"), _spec((m,), "float32"), *w]
    return int8_matmul, [_spec((m, k), "bfloat16"), *w]


def attention_case(
    t, b, context, *, q_dtype="bfloat16", kv_dtype=None, window=None, heads=None, head_dim=None
):
    """T query rows over B sequences of `context` tokens, one layer's pages."""
    h, kh = heads or (HEADS, KV_HEADS)
    d = head_dim or HEAD_DIM
    per_seq = -(-context // BLOCK)
    pages = (b * per_seq, kh, BLOCK, d)
    args = [
        _spec((t, h, d), q_dtype),
        _spec(pages, kv_dtype or q_dtype),
        _spec(pages, kv_dtype or q_dtype),
        _spec((b + 1,), "int32"),
        _spec((b,), "int32"),
        _spec((b, per_seq), "int32"),
    ]
    if kv_dtype in ("int8", "float8_e4m3fn"):
        args += [_spec(pages[:3], "float32")] * 2

        def fn(q, k, v, qs, sl, bt, ks, vs):
            return ragged_paged_attention(
                q, k, v, qs, sl, bt, sliding_window=window, k_scale=ks, v_scale=vs
            )

        return fn, args
    return lambda *a: ragged_paged_attention(*a, sliding_window=window), args


def bench_cases(int4_m, contexts, batches) -> list[tuple[str, object, list]]:
    """What `kernel_bench.py` times with the same flags."""
    cases = []
    g = kernel_bench.GROUP
    for k, n in kernel_bench.LLAMA2_7B_SHAPES:
        for m in int4_m:
            cases.append((f"int4 bench M={m} {k}x{n} bf16 G={g}", *int4_case(m, k, n, g)))
    for c in contexts:
        for b in batches:
            cases.append((f"attention bench decode ctx={c} B={b} bf16", *attention_case(b, b, c)))
    return cases


def extra_cases() -> list[tuple[str, object, list]]:
    """Dtypes, options and query mixes beyond the bench: what tests and the model exercise."""
    return [
        ("int4 M=16 4096x4096 f32 G=128", *int4_case(16, 4096, 4096, dtype="float32")),
        ("int4 M=16 4096x4096 f16 G=64 perm", *int4_case(16, 4096, 4096, 64, "float16", True)),
        ("int4 M=1 4096x4096 bf16 per-channel", *int4_case(1, 4096, 4096, g=4096)),
        ("int4 M=1000 4096x4096 bf16 G=128", *int4_case(1000, 4096, 4096)),
        ("int8 W8A16 M=1 4096x4096", *int8_case(1, 4096, 4096)),
        ("int8 W8A16 M=256 4096x4096", *int8_case(256, 4096, 4096)),
        ("int8 W8A8 M=1 4096x4096", *int8_case(1, 4096, 4096, w8a8=True)),
        ("int8 W8A8 M=256 4096x4096", *int8_case(256, 4096, 4096, w8a8=True)),
        ("attention verify B=16 q_len=5 ctx=4096", *attention_case(80, 16, 4096)),
        ("attention prefill chunk 512 ctx=4096", *attention_case(512, 1, 4096)),
        (
            "attention decode int8 pages ctx=4096 B=16",
            *attention_case(16, 16, 4096, kv_dtype="int8"),
        ),
        (
            "attention decode fp8 pages ctx=4096 B=16",
            *attention_case(16, 16, 4096, kv_dtype="float8_e4m3fn"),
        ),
        ("attention decode window=4096 ctx=32768 B=1", *attention_case(1, 1, 32768, window=4096)),
        ("attention decode f32 ctx=4096 B=16", *attention_case(16, 16, 4096, q_dtype="float32")),
        ("attention decode f16 ctx=4096 B=16", *attention_case(16, 16, 4096, q_dtype="float16")),
        (
            "attention decode MHA D=64 ctx=4096 B=16",
            *attention_case(16, 16, 4096, heads=(16, 16), head_dim=64),
        ),
        (
            "attention decode GQA D=256 ctx=4096 B=16",
            *attention_case(16, 16, 4096, heads=(16, 8), head_dim=256),
        ),
        (
            "attention verify GQA D=256 B=16 q_len=5",
            *attention_case(80, 16, 4096, heads=(16, 8), head_dim=256),
        ),
        (
            "attention prefill MQA D=256 ctx=2048",
            *attention_case(256, 1, 2048, heads=(8, 1), head_dim=256),
        ),
    ]


def model_cases() -> list[tuple[str, object, list]]:
    """One paged forward of the shipped target on the Pallas backend (float, int4, int8).

    The batch mixes a prefill chunk, a verification-sized chunk and a decode row, as the engine's
    steps do; the quantized params come from RTN (no calibration statistics needed).
    """
    import numpy as np  # noqa: PLC0415 (the model part only)

    import jaxinfer as ji  # noqa: PLC0415 (kept out of the kernel-only cases)
    from jaxinfer.cache.metadata import SeqChunk, build_metadata  # noqa: PLC0415

    cfg, params = ji.load_checkpoint(ji.models.path("target"))
    rng = np.random.RandomState(0)
    calib = rng.randint(0, cfg.vocab_size, (2, 32))
    block = 16
    chunks = [
        SeqChunk(rng.randint(0, cfg.vocab_size, 40).tolist(), 0, [0, 1, 2]),
        SeqChunk(rng.randint(0, cfg.vocab_size, 5).tolist(), 30, [3, 4, 5]),
        SeqChunk(rng.randint(0, cfg.vocab_size, 1).tolist(), 20, [6, 7]),
    ]
    meta, _ = build_metadata(chunks, block)
    meta = ji.BatchMetadata(*(jnp.asarray(x) for x in meta.__dict__.values()))
    cache = ji.init_cache(cfg, 8, block)
    cases = []
    for name, qcfg in (
        ("float32", None),
        ("int4 rtn G=128", ji.quant.QuantConfig(method="rtn", bits=4, group_size=128)),
        ("int8 W8A16", ji.quant.QuantConfig(method="rtn", bits=8, group_size=None)),
        ("int8 W8A8", ji.quant.QuantConfig(method="smoothquant", bits=8, group_size=None)),
    ):
        p = params if qcfg is None else ji.quant.quantize(cfg, params, qcfg, calib)

        def fn(p, meta, cache):
            return ji.forward(p, cfg, meta, cache, backend="pallas")

        cases.append((f"model target {name}: mixed paged step", fn, [p, meta, cache]))
    return cases


# ----------------------------------------------------------------------------- capture


@dataclasses.dataclass
class TritonKernel:
    name: str
    ir: bytes  # the Triton module as MLIR bytecode
    num_warps: int
    num_stages: int
    grid: tuple[int, int, int]


def capture_triton(fn, args) -> list[TritonKernel]:
    """Lowers `fn(*args)` for CUDA and returns the Triton module of every pallas_call in it."""
    captured: list[TritonKernel] = []
    real_custom_call = mlir.custom_call
    real_compile = pallas_call_registration.triton.compile
    state = {}

    def spy_custom_call(call_target_name, *a, backend_config=None, **kw):
        if call_target_name == "__gpu$xla.gpu.triton":  # jaxlib <= 0.10.2
            cfg = backend_config
            captured.append(
                TritonKernel(
                    name=cfg["name"].value,
                    ir=cfg["ir"].value_bytes,
                    num_warps=int(cfg["num_warps"].value),
                    num_stages=int(cfg["num_stages"].value),
                    grid=tuple(int(cfg[f"grid_{x}"].value) for x in "xyz"),
                )
            )
        elif call_target_name == "triton_kernel_call_ffi" and "pending" in state:
            name = backend_config["name"].value if backend_config else "?"
            captured.append(dataclasses.replace(state.pop("pending"), name=name))
        return real_custom_call(call_target_name, *a, backend_config=backend_config, **kw)

    def spy_compile(platform, module, arch_name, *, num_warps, num_ctas, num_stages):  # jax >= 0.11
        state["pending"] = TritonKernel("?", module, num_warps, num_stages, (0, 0, 0))
        return real_compile(
            platform, module, arch_name, num_warps=num_warps, num_ctas=num_ctas,
            num_stages=num_stages,
        )  # fmt: skip

    mlir.custom_call = spy_custom_call
    pallas_call_registration.triton.compile = spy_compile
    # jaxinfer refuses backend="pallas" on a CPU unless told the trace is lowered for CUDA only;
    # the kernel-only cases never import it.
    ops = sys.modules.get("jaxinfer.ops.backend")
    gpu_lowering = ops.lowering_for_gpu() if ops is not None else contextlib.nullcontext()
    try:
        with gpu_lowering:
            jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    finally:
        mlir.custom_call = real_custom_call
        pallas_call_registration.triton.compile = real_compile
    return captured


# ----------------------------------------------------------------------------- compile + inspect


def _tool(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    import nvidia  # noqa: PLC0415 (the nvidia-* wheels' namespace package)

    for root in nvidia.__path__:
        hits = sorted(glob.glob(os.path.join(root, "**", "bin", name), recursive=True))
        if hits:
            return hits[-1]
    return None


def parse_ptxas(text: str) -> dict:
    """Registers, spills and stack of the one entry function in `ptxas -v` output."""
    out = {}
    spills = r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
    if m := re.search(spills, text):
        out["stack_bytes"], out["spill_store_bytes"], out["spill_load_bytes"] = map(int, m.groups())
    if m := re.search(r"Used (\d+) registers", text):
        out["registers"] = int(m.group(1))
    return out


_SASS_OP = re.compile(
    r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[0-9T]\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)"
)


def instruction_mix(sass: str) -> dict:
    """Counts of the instructions that say how a kernel uses the chip, from nvdisasm output."""
    ops = collections.Counter(m.group(1) for m in _SASS_OP.finditer(sass))

    def count(pred):
        return sum(n for op, n in ops.items() if pred(op))

    def global_loads(width):
        return count(lambda op: op.startswith(("LDG.", "LDGSTS.")) and str(width) in op.split("."))

    return {
        "instructions": sum(ops.values()),
        "gmma": count(lambda op: op.startswith(("HGMMA", "IGMMA", "QGMMA"))),  # Hopper wgmma
        "mma": count(lambda op: op.startswith(("HMMA", "IMMA"))),  # Ampere-style warp MMA
        "ffma": count(lambda op: op.startswith("FFMA")),
        "global_loads_128": global_loads(128),
        "global_loads_64": global_loads(64),
        "global_loads": count(lambda op: op.startswith(("LDG.", "LDGSTS."))),
        "local_memory": count(lambda op: op.startswith(("LDL", "STL"))),
    }


def inspect_kernel(kernel: TritonKernel, arch: str, ptxas: str | None, nvdisasm: str | None):
    row = {"kernel": kernel.name, "grid": list(kernel.grid), "num_warps": kernel.num_warps,
           "num_stages": kernel.num_stages}  # fmt: skip
    try:
        result = triton.compile(
            "cuda", kernel.ir, arch, num_warps=kernel.num_warps, num_ctas=1,
            num_stages=kernel.num_stages,
        )  # fmt: skip
    except Exception as e:  # noqa: BLE001 (the report records any compiler failure)
        row["error"] = f"{type(e).__name__}: {e}"[:2000]
        return row
    row["smem_bytes"] = int(result.smem_bytes)
    target = re.search(r"^\.target\s+(\S+)", result.asm, re.M)
    row["ptx_target"] = target.group(1) if target else None
    if ptxas and row["ptx_target"]:
        with tempfile.TemporaryDirectory() as tmp:
            ptx, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
            with open(ptx, "w") as f:
                f.write(result.asm)
            run = subprocess.run(
                [ptxas, f"-arch={row['ptx_target']}", "-v", ptx, "-o", cubin],
                capture_output=True, text=True, check=False,
            )  # fmt: skip
            if run.returncode:
                row["error"] = "ptxas: " + run.stderr[-2000:]
                return row
            row.update(parse_ptxas(run.stderr + run.stdout))
            # e.g. C7517/C7519: ptxas had to add warpgroup waits around a wgmma's registers
            notes = re.findall(r"\((C\d{4})\) (.*?) in function", run.stderr)
            where = re.compile(r" in around line \d+")
            row["ptxas_notes"] = sorted({f"{c} {where.sub('', text)}" for c, text in notes})
            if nvdisasm:
                dis = subprocess.run([nvdisasm, cubin], capture_output=True, text=True, check=False)
                if dis.returncode == 0:
                    row.update(instruction_mix(dis.stdout))
    return row


def problems(row: dict, smem_limit: int) -> list[str]:
    out = []
    if "error" in row:
        out.append("does not compile")
    if row.get("smem_bytes", 0) > smem_limit:
        out.append(f"shared memory {row['smem_bytes']} > {smem_limit}")
    if row.get("spill_store_bytes", 0) or row.get("spill_load_bytes", 0):
        out.append("register spills")
    return out


# ----------------------------------------------------------------------------- main


def _table(rows: list[dict]) -> str:
    head = (
        f"{'case':<46} {'kernel':<22} {'grid':>16} {'w':>2} {'st':>2} {'smem KiB':>8} {'regs':>4}"
        f" {'spill':>5} {'mma':>9} {'ld128/ld':>9} ok  ptxas notes"
    )
    lines = [head]
    for r in rows:
        mma = f"{r['gmma']} gmma" if r.get("gmma") else f"{r.get('mma', '-')} mma"
        loads = f"{r.get('global_loads_128', '-')}/{r.get('global_loads', '-')}"
        lines.append(
            f"{r['case'][:46]:<46} {r['kernel'][:22]:<22} {'x'.join(map(str, r['grid'])):>16}"
            f" {r['num_warps']:>2} {r['num_stages']:>2} {r.get('smem_bytes', 0) / 1024:>8.1f}"
            f" {r.get('registers', '-'):>4} {r.get('spill_store_bytes', '-'):>5} {mma:>9}"
            f" {loads:>9} {'yes' if not r['problems'] else '; '.join(r['problems'])}"
            f"  {' '.join(n.split()[0] for n in r.get('ptxas_notes', []))}"
        )
    return "\n".join(lines)


def main(argv):
    del argv
    common.apply_config(flags.FLAGS.config)
    jax.devices()  # initialises the plugins, which register Triton's compilation handler
    if not triton.has_compilation_handler("cuda"):
        sys.exit(
            "No Triton compilation handler for CUDA: install jax-cuda12-plugin and "
            "jax-cuda12-pjrt of this jax's version (see this script's docstring)."
        )
    ptxas, nvdisasm = _tool("ptxas"), _tool("nvdisasm")
    print(f"jax {jax.__version__}, arch {_ARCH.value}, ptxas {ptxas}, nvdisasm {nvdisasm}")
    workdir = flags.FLAGS.workdir
    common.save_config(workdir, resolved={"ptxas": ptxas, "nvdisasm": nvdisasm})
    flag_values = flags.FLAGS
    sizes = [
        [int(v) for v in flag_values[name].value] for name in ("int4_m", "contexts", "batches")
    ]
    cases = bench_cases(*sizes) + extra_cases() + (model_cases() if _MODEL.value else [])
    rows, seen = [], {}
    for case, fn, args in cases:
        kernels = capture_triton(fn, args)
        if not kernels:
            rows.append({"case": case, "kernel": "-", "grid": [], "num_warps": 0, "num_stages": 0,
                         "problems": ["no pallas_call lowered"]})  # fmt: skip
        for kernel in kernels:
            digest = hashlib.sha256(
                kernel.ir + f"{kernel.num_warps},{kernel.num_stages}".encode()
            ).hexdigest()
            if digest not in seen:
                seen[digest] = inspect_kernel(kernel, _ARCH.value, ptxas, nvdisasm)
            row = {"case": case, **seen[digest], "grid": list(kernel.grid)}
            row["problems"] = problems(row, _SMEM_LIMIT.value)
            print(("ok   " if not row["problems"] else "FAIL ") + json.dumps(row))
            rows.append(row)
    results = {"jax": jax.__version__, "arch": _ARCH.value, "rows": rows}
    common.write_json(workdir, "compile_check.json", results)  # its old name, kept for readers
    common.write_results(workdir, results)
    print(_table(rows))
    bad = [r for r in rows if r["problems"]]
    print(
        f"{len(rows)} kernels in {len(cases)} cases, {len(seen)} distinct; {len(bad)} with problems"
    )
    if bad:
        sys.exit(1)


if __name__ == "__main__":
    app.run(main)
