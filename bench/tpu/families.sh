# Issue 38 on the TPU v5e chip: the new families beside MaxText's closest model, in one sitting.
#   bash bench/tpu/families.sh [check] [llama] [mt_llama] [moe] [gptoss] [mt_gptoss]
#     (no argument: all of them, in that order)
# From the repo root on the TPU machine, with .whl-tpu/ and .peers/maxtext-tpu/ carried (see
# bench/tpu/device_setup.sh). No real size of the four families fits one v5e chip (15.75 GiB)
# with fp32 AdamW, so each runs cut to layers that do, the same cut on both sides:
#   llama   Llama-3.2-1B's shapes (configs/models/llama-3.2-1b.toml), 8 of its 16 layers,
#           2,048 x 4 (plan: peak 13.18 GiB); MaxText: llama3.1-8b with the 1B's widths
#   gptoss  gpt-oss-20b's shapes, 2 layers (one sliding, one full), 8 of 32 experts, vocab 32,000,
#           2,048 x 8 (plan: peak 12.27 GiB); MaxText: gpt-oss-20b cut the same way
#   moe     the Qwen3-30B-A3B cut of bench/tpu/moe_vs_maxtext.sh (2 layers, 32 experts, vocab 32,000, 2,048 x 8), the
#           defaults of today's tree (its first 56,010 tokens/s was measured before the
#           families' merge touched the expert dispatch)
#   check   bench/tpu/gpt_oss_check.py: splash with sinks and windows against the einsum path
# Writes under $OUT: session.log, jj.jsonl (accel_step rows), mt.log (MaxText's
# MAXTEXT_TPU_JSON lines), gpt_oss_check.jsonl, err.log (the tail of stderr).
set -u
OUT=${OUT:-/tmp/families-out}
mkdir -p "$OUT"
exec 3>>"$OUT/session.log"
say() { echo "[families $(date +%T)] $*" | tee /dev/fd/3 >&2; }
PHASES=" ${*:-check llama mt_llama moe gptoss mt_gptoss} "
MACHINE_PYTHONPATH=${PYTHONPATH:-}
LLAMA=(--model configs/models/llama-3.2-1b.toml --set model.num_layers=8 --shapes 2048x4)
GPTOSS=(--model configs/models/gpt-oss-20b.toml --set model.num_layers=2
  --set model.gpt_oss.num_local_experts=8 --set model.vocab_size=32000 --shapes 2048x8)
MOE=(--model configs/models/qwen3-30b-a3b.toml --set model.num_layers=2
  --set model.num_experts=32 --set model.vocab_size=32000 --shapes 2048x8)

say "setup"
# shellcheck disable=SC1091
source bench/tpu/device_setup.sh || { say "jaxjob setup failed"; exit 2; }

maxtext() {  # $1 = label, $2 = MaxText model_name, $3 = per-device batch, rest = overrides
  local label=$1 model=$2 pdb=$3; shift 3
  say "maxtext $label"
  (
    export PYTHONPATH=$MACHINE_PYTHONPATH
    cd .peers && timeout "${MT_TIMEOUT:-200}" env KEEP_SITE=1 STEPS=20 MODEL="$model" MTRUN=/tmp/mtrun \
      PER_DEVICE_BATCH_SIZE="$pdb" MAX_TARGET_LENGTH=2048 bash maxtext-tpu/run_tpu.sh "$@"
  ) >"$OUT/mt.all" 2>&1
  local rc=$?
  say "maxtext $label rc=$rc $(grep -h MAXTEXT_TPU_JSON "$OUT/mt.all" | cut -c1-300)"
  grep -h MAXTEXT_TPU_JSON "$OUT/mt.all" | sed "s/^/$label /" >>"$OUT/mt.log"
  [ $rc -ne 0 ] && grep -E "Error|error:|RESOURCE_EXHAUSTED" "$OUT/mt.all" | tail -5 >>"$OUT/mt.log"
  rm -f "$OUT/mt.all"
}

if [[ $PHASES == *" check "* ]]; then
  say "gpt_oss_check"
  OUT=$OUT timeout 150 python3 bench/tpu/gpt_oss_check.py >/dev/null 2>>"$OUT/err.log"
  say "gpt_oss_check rc=$?"
fi
if [[ $PHASES == *" llama "* ]]; then
  say "llama cut: remat full (the preset) and auto"
  timeout 150 python3 bench/accel_step.py "${LLAMA[@]}" --steps 8 --variant "llama_full:model.remat=full" \
    --variant "llama_auto:model.remat=auto" >>"$OUT/jj.jsonl" 2>>"$OUT/err.log"
  say "llama rc=$?"
fi
if [[ $PHASES == *" mt_llama "* ]]; then
  maxtext llama llama3.1-8b 4 override_model_config=true base_emb_dim=2048 \
    base_num_query_heads=32 base_num_kv_heads=8 head_dim=64 base_mlp_dim=8192 \
    base_num_decoder_layers=8 logits_via_embedding=true
fi
if [[ $PHASES == *" moe "* ]]; then
  say "moe cut: the defaults"
  timeout 120 python3 bench/accel_step.py "${MOE[@]}" --steps 8 --variant "moe_cut:" \
    >>"$OUT/jj.jsonl" 2>>"$OUT/err.log"
  say "moe rc=$?"
fi
if [[ $PHASES == *" gptoss "* ]]; then
  say "gpt-oss cut: the defaults"
  timeout 150 python3 bench/accel_step.py "${GPTOSS[@]}" --steps 8 --variant "gptoss_cut:" \
    >>"$OUT/jj.jsonl" 2>>"$OUT/err.log"
  say "gptoss rc=$?"
fi
if [[ $PHASES == *" mt_gptoss "* ]]; then
  maxtext gptoss gpt-oss-20b 8 override_model_config=true base_num_decoder_layers=2 num_experts=8 \
    vocab_size=32000
fi
[ -f "$OUT/err.log" ] && tail -40 "$OUT/err.log" >"$OUT/err.tail" && mv "$OUT/err.tail" "$OUT/err.log"
say "done"
