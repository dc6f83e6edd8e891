"""experiments/kernel_compile_check.py: capturing Triton modules and reading the tools' output.

Compiling to PTX needs the CUDA plugin (not a test dependency); capturing the Triton module of
each pallas_call needs only a CPU, and is what breaks first when jax's internals move.
"""

import jax.numpy as jnp
import pytest

from experiments import kernel_compile_check as kcc
from pallas_kernels.int4_matmul import default_block_sizes, plan_tiles
from pallas_kernels.paged_attention import default_attention_block_sizes

PTXAS = """\
ptxas info    : (C7519) warpgroup.arrive is injected in around line 462 by compiler to allow use \
of registers in GMMA in function 'k'
ptxas info    : (C7519) warpgroup.arrive is injected in around line 531 by compiler to allow use \
of registers in GMMA in function 'k'
ptxas info    : Compiling entry function 'k' for 'sm_90a'
ptxas info    : Function properties for k
    16 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers
"""

SASS = """\
        /*0350*/              @!PT LDS RZ, [RZ] ;
        /*0380*/                   LDGSTS.E.BYPASS.128 [R3], desc[UR22][R4.64], P0 ;
        /*0390*/                   LDG.E.64.CONSTANT R8, desc[UR4][R2.64] ;
        /*03a0*/              @!P0 LDGSTS.E [R27+0x8000], desc[UR14][R12.64], P1 ;
        /*03b0*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*03c0*/                   HMMA.16816.F32.BF16 R16, R8, R14, R16 ;
        /*03d0*/                   IGMMA.64x128x32.S8.S8 R24, gdesc[UR4], RZ, !UPT ;
        /*03e0*/               @P1 STL [R1], R5 ;
        /*03f0*/                   FFMA R0, R1, R2, R3 ;
"""


def test_parse_ptxas():
    assert kcc.parse_ptxas(PTXAS) == {
        "stack_bytes": 16,
        "spill_store_bytes": 8,
        "spill_load_bytes": 12,
        "registers": 255,
    }


def test_instruction_mix():
    mix = kcc.instruction_mix(SASS)
    assert mix == {
        "instructions": 9,
        "gmma": 1,
        "mma": 2,
        "ffma": 1,
        "global_loads_128": 1,
        "global_loads_64": 1,
        "global_loads": 3,
        "local_memory": 1,
    }


@pytest.mark.parametrize(
    "row,expected",
    [
        ({"smem_bytes": 1000, "spill_store_bytes": 0, "spill_load_bytes": 0}, []),
        ({"smem_bytes": 300 * 1024}, ["shared memory 307200 > 232448"]),
        ({"spill_load_bytes": 4}, ["register spills"]),
        ({"error": "boom"}, ["does not compile"]),
    ],
)
def test_problems(row, expected):
    assert kcc.problems(row, 227 * 1024) == expected


def test_captures_int4_kernel_with_its_launch_parameters():
    m, k, n = 3, 512, 256
    fn, args = kcc.int4_case(m, k, n, g=128)
    (kernel,) = kcc.capture_triton(fn, args)
    sizes = default_block_sizes(m)
    assert kernel.name == "int4_matmul"
    assert kernel.grid == plan_tiles(m, k, n, sizes, 128).grid
    assert (kernel.num_warps, kernel.num_stages) == (sizes.num_warps, sizes.num_stages)
    assert kernel.ir.startswith(b"ML\xefR")  # MLIR bytecode


def test_captures_attention_kernel_and_nothing_else():
    t, b, context = 5, 1, 64
    fn, args = kcc.attention_case(t, b, context, q_dtype="float32", kv_dtype="int8", window=8)
    (kernel,) = kcc.capture_triton(fn, args)
    sizes = default_attention_block_sizes(t, b, kcc.HEAD_DIM)
    assert kernel.name == "ragged_paged_attention"
    assert kernel.grid[1] == kcc.KV_HEADS  # grid (query tiles, kv heads, partitions)
    assert kernel.num_warps == sizes.num_warps
    # Nothing else in a graph is taken for a kernel.
    assert kcc.capture_triton(lambda x: jnp.sin(x) @ x, [kcc._spec((4, 4), "float32")]) == []
