#!/usr/bin/env bash
# The prepared GPU run behind BENCHMARKS.md's "GPU" section: one command on a lent machine.
#
#   bash experiments/device_run.sh "$OUT"        # from the checkout; results under $OUT
#
# Three independent steps, each under its own time limit (about 7 minutes in all), so that a
# failure or a hang in one still leaves the others' results: the environment; kernel_bench
# (compiled vs reference and interpret mode, then the timings against bf16 jnp.dot, contiguous
# attention and a copy); attention_bench (the model's step on the Pallas, XLA and reference
# attention backends). Each step's full log and JSON land in the output folder; the tails of
# the tables print last. Runs with whatever jax the machine has (PYTHONPATH=., no install).
set -u
out=${1:-runs/device}
mkdir -p "$out"
export PYTHONPATH=.
py=$(command -v python3 || command -v python)

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
  "$py" -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"
} > "$out/env.txt" 2>&1
cat "$out/env.txt"

timeout 300 "$py" -m experiments.kernel_bench --workdir="$out/kernel_bench" \
  > "$out/kernel_bench.log" 2>&1
echo "kernel_bench exit $?"
timeout 120 "$py" -m experiments.attention_bench --backends=pallas,xla,reference \
  --workdir="$out/attention_bench" > "$out/attention_bench.log" 2>&1
echo "attention_bench exit $?"

grep -v '^ok ' "$out/kernel_bench.log" | tail -45
tail -25 "$out/attention_bench.log"
