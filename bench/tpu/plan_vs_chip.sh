# Issue 37, goal 5 on the TPU v5e chip: `runtime plan`'s predicted step time against the
# measured step, Qwen3-0.6B at 2,048 x 8, 4,096 x 4, 8,192 x 2 and 16,384 x 1 and the MoE cut
# (Qwen3-30B-A3B's shape: 2 layers of 32 experts, vocab 32,000) at 2,048 x 8, with the defaults.
#   bash bench/tpu/plan_vs_chip.sh
# From the repo root on the TPU machine, with .whl-tpu/ and .peers/ carried (device_setup.sh);
# about 4 minutes of chip time, at most 6 (the phases' timeouts). The predictions are compiled
# on this machine's CPUs, deviceless for tpu-v5e-1 (bench/tpu/plan_vs_chip.py --predict: the run
# config accel_step builds, planned as `runtime plan` plans it), beside the measurements and at
# low priority; they touch no chip.
# Writes under $OUT:
#   session.log       what ran, when, and each phase's exit status
#   predicted.jsonl   plan_step rows: predicted seconds, bound, the kernels' part
#   measured.jsonl    bench/accel_step.py rows (step_s: the mean of 5 steps after a warm one)
#   plan_vs_chip.jsonl  {shape, model, predicted_s, measured_s, ratio} per shape
#   *.err             each phase's stderr (tail)
set -u
OUT=${OUT:-/tmp/plan-vs-chip-out}
mkdir -p "$OUT"
exec 3>>"$OUT/session.log"
say() { echo "[plan-vs-chip $(date +%T)] $*" | tee /dev/fd/3 >&2; }
DENSE=(--model configs/models/qwen3-0.6b.toml)
CUT=(--model configs/models/qwen3-30b-a3b.toml --set model.num_layers=2 --set model.num_experts=32
  --set model.vocab_size=32000)
SHAPES=2048x8,4096x4,8192x2,16384x1

say "setup"
# shellcheck disable=SC1091
source bench/tpu/device_setup.sh || { say "jaxjob setup failed"; exit 2; }

# Deviceless compiles (JAX_PLATFORMS=cpu: no chip, no libtpu lock), niced below the measurements
# they run beside.
say "predict (background)"
PREDICT=(env JAX_PLATFORMS=cpu timeout 300 nice -n 19 python3 bench/tpu/plan_vs_chip.py --predict)
("${PREDICT[@]}" "${DENSE[@]}" --shapes "$SHAPES" >"$OUT/predicted-dense.jsonl" \
  2>"$OUT/predict-dense.err"; echo "predict dense rc=$?" >&3) &
DENSE_PID=$!
("${PREDICT[@]}" "${CUT[@]}" --shapes 2048x8 >"$OUT/predicted-moe.jsonl" \
  2>"$OUT/predict-moe.err"; echo "predict moe rc=$?" >&3) &
MOE_PID=$!

say "measure: dense $SHAPES"
timeout 220 python3 bench/accel_step.py "${DENSE[@]}" --shapes "$SHAPES" --steps 5 \
  >>"$OUT/measured.jsonl" 2>"$OUT/measure-dense.err"
say "measure dense rc=$?"
say "measure: MoE cut 2048x8"
timeout 120 python3 bench/accel_step.py "${CUT[@]}" --shapes 2048x8 --steps 5 \
  >>"$OUT/measured.jsonl" 2>"$OUT/measure-moe.err"
say "measure moe rc=$?"

say "waiting for the predictions"
wait "$DENSE_PID" "$MOE_PID"
cat "$OUT/predicted-dense.jsonl" "$OUT/predicted-moe.jsonl" >"$OUT/predicted.jsonl" 2>/dev/null
rm -f "$OUT/predicted-dense.jsonl" "$OUT/predicted-moe.jsonl"
python3 bench/tpu/plan_vs_chip.py --join "$OUT/predicted.jsonl" "$OUT/measured.jsonl" \
  >"$OUT/plan_vs_chip.jsonl" 2>>"$OUT/join.err"
say "join rc=$?"
cat "$OUT/plan_vs_chip.jsonl" >&2
for f in "$OUT"/*.err; do [ -f "$f" ] && tail -30 "$f" >"$f.tail" && mv "$f.tail" "$f"; done
say "done"
