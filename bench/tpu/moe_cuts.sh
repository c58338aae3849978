# More cuts of Qwen3-30B-A3B's MoE than the first one (bench/tpu/moe_vs_maxtext.sh) (other top-k, expert counts, layers,
# sequence and batch), MaxText then jaxjob on each, plus MaxText's dense Qwen3-0.6B at long
# sequences, in one device call.
#   [SIDES=maxtext] bash bench/tpu/moe_cuts.sh [CUT ...]   (default: every cut below, then dense8k)
# From the repo root on the TPU machine, with .whl-tpu/ and .peers/maxtext-tpu/ carried (see
# bench/tpu/device_setup.sh). Writes under $OUT: session.log, mt-<cut>.log (MaxText's step lines
# and MAXTEXT_TPU_JSON), jj.jsonl (bench/accel_step.py rows, `variant` = the cut's name).
set -u
OUT=${OUT:-/tmp/moe-cuts}
mkdir -p "$OUT"
exec 3>>"$OUT/session.log"
say() { echo "[cuts $(date +%T)] $*" | tee /dev/fd/3 >&2; }
MACHINE_PYTHONPATH=${PYTHONPATH:-}

# name | layers experts top-k | seq x batch
CUTS=(
  "top4|2 32 4|2048x8"
  "e16top2l4|4 16 2|2048x8"
  "seq4096|2 32 8|4096x4"
)
WANT=" ${*:-top4 e16top2l4 seq4096 dense8k} "

say "setup"
# shellcheck disable=SC1091
source bench/tpu/device_setup.sh || { say "jaxjob setup failed"; exit 2; }

maxtext() {  # $1 = log name, rest = env assignments then run_tpu.sh overrides
  local log=$1; shift
  (
    export PYTHONPATH=$MACHINE_PYTHONPATH
    cd .peers && timeout 240 env KEEP_SITE=1 STEPS=20 MTRUN=/tmp/mtrun "$@"
  ) >"$OUT/mt-$log.log" 2>&1
  say "maxtext $log rc=$? $(grep -h MAXTEXT_TPU_JSON "$OUT/mt-$log.log" | cut -c1-200)"
}

for cut in "${CUTS[@]}"; do
  IFS='|' read -r name shape_args shape <<<"$cut"
  [[ $WANT == *" $name "* ]] || continue
  read -r layers experts topk <<<"$shape_args"
  seq=${shape%x*}; batch=${shape#*x}
  say "cut $name: $layers layers, $experts experts, top-$topk, $seq x $batch"
  maxtext "$name" MODEL=qwen3-30b-a3b OOM_RETRY=0 PER_DEVICE_BATCH_SIZE="$batch" \
    MAX_TARGET_LENGTH="$seq" bash maxtext-tpu/run_tpu.sh override_model_config=true \
    base_num_decoder_layers="$layers" num_experts="$experts" num_experts_per_tok="$topk" \
    vocab_size=32000
  [ "${SIDES:-both}" = maxtext ] && continue
  timeout 200 python3 bench/accel_step.py --model configs/models/qwen3-30b-a3b.toml \
    --shapes "$shape" --steps 20 --variant "$name:model.num_layers=$layers;model.num_experts=$experts;model.num_experts_per_tok=$topk;model.vocab_size=32000" \
    >>"$OUT/jj.jsonl" 2>>"$OUT/jj.log"
  say "jaxjob $name rc=$? $(tail -1 "$OUT/jj.jsonl" | cut -c1-160)"
done

if [[ $WANT == *" dense8k "* ]]; then
  # MaxText's defaults at 8,192: batch 2, halving on RESOURCE_EXHAUSTED (OOM_RETRY=1 also tries
  # num_vocab_tiling=8 first).
  maxtext dense8k PER_DEVICE_BATCH_SIZE=2 MAX_TARGET_LENGTH=8192 bash maxtext-tpu/run_tpu.sh
fi
say done
