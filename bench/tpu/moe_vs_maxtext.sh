# The MoE cut (Qwen3-30B-A3B's shape: 2 layers of 32 experts, top-8, vocab 32,000, seq
# 2,048 x 8) on the TPU chip, MaxText and jaxjob in one sitting, each with its step profiled.
#   bash bench/tpu/moe_vs_maxtext.sh [maxtext] [jaxjob] [variants] [VARIANT_SPEC ...]
# From the repo root on the TPU machine, with .whl-tpu/ and .peers/maxtext-tpu/ carried (see
# bench/tpu/device_setup.sh). Writes under $OUT (at most 7 files): session.log, mt.log (MaxText's
# step lines and MAXTEXT_TPU_JSON), mt-profile.json (bench/tpu/xplane_summary.py over MaxText's
# trace of 3 steps), mt-hlo.tgz (MaxText's optimised train_step HLO), jj.jsonl (accel_step rows),
# jj.log (the per-op tables), jj.tgz (bench/tpu/moe_profile.py's profiles and HLO). `variants`
# runs the VARIANT_SPECs given (accel_step --variant syntax), or a default list.
set -u
OUT=${OUT:-/tmp/moe-out}
mkdir -p "$OUT" /tmp/jj
exec 3>>"$OUT/session.log"
say() { echo "[moe $(date +%T)] $*" | tee /dev/fd/3 >&2; }
MACHINE_PYTHONPATH=${PYTHONPATH:-}
PHASES=" ${*} "
CUT=(--model configs/models/qwen3-30b-a3b.toml --set model.num_layers=2 --set model.num_experts=32
  --set model.vocab_size=32000)
trap 'tar czf "$OUT/jj.tgz" -C /tmp/jj . 2>/dev/null; say done' EXIT

say "setup"
# shellcheck disable=SC1091
source bench/tpu/device_setup.sh || { say "jaxjob setup failed"; exit 2; }
python3 -c 'import platform, jax; print(platform.libc_ver(), jax.__version__, jax.devices())' >&3 2>&1

if [[ $PHASES == *" maxtext "* ]]; then
  say "maxtext"
  (
    export PYTHONPATH=$MACHINE_PYTHONPATH
    export XLA_FLAGS="--xla_dump_to=/tmp/mtdump --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*train_step.*"
    cd .peers && MODEL=qwen3-30b-a3b STEPS=20 OOM_RETRY=0 MTRUN=/tmp/mtrun timeout 200 \
      bash maxtext-tpu/run_tpu.sh override_model_config=true base_num_decoder_layers=2 \
      num_experts=32 vocab_size=32000 profiler=xplane skip_first_n_steps_for_profiler=10 \
      profiler_steps=3
  ) >"$OUT/mt.log" 2>&1
  say "maxtext rc=$?"
  grep -h -E "Error|error|Traceback" /tmp/mtrun/train_*.log 2>/dev/null | head -20 >>"$OUT/mt.log"
  TRACE=$(find /tmp/mtrun -name '*.xplane.pb' | head -1)
  [ -n "$TRACE" ] && PYTHONPATH=$MACHINE_PYTHONPATH timeout 60 python3 bench/tpu/xplane_summary.py \
    "$(dirname "$TRACE")" --out "$OUT/mt-profile.json" --top 40 >>"$OUT/mt.log" 2>&1
  (cd /tmp/mtdump 2>/dev/null && tar czf "$OUT/mt-hlo.tgz" ./*after_optimizations*.txt)
fi

if [[ $PHASES == *" jaxjob "* ]]; then
  say "jaxjob baseline"
  timeout 150 python3 bench/tpu/moe_profile.py --out-dir /tmp/jj --hlo "${CUT[@]}" \
    --profile-top 25 >>"$OUT/jj.jsonl" 2>>"$OUT/jj.log"
  say "jaxjob baseline rc=$?"
fi

if [[ $PHASES == *" variants "* ]]; then
  SPECS=()
  for a in "$@"; do [[ $a == *:* ]] && SPECS+=(--variant "$a"); done
  if [ ${#SPECS[@]} -eq 0 ]; then
    SPECS=(--variant "tiles512:kernel.gmm_tiling=512x1024x1024"
      --variant "gather:kernel.permute=gather"
      --variant "tiles512+gather:kernel.gmm_tiling=512x1024x1024;kernel.permute=gather"
      --variant "remat_block:model.remat=block")
  fi
  say "jaxjob variants ${SPECS[*]}"
  timeout "${VARIANTS_TIMEOUT:-200}" python3 bench/tpu/moe_profile.py --out-dir /tmp/jj --hlo \
    "${CUT[@]}" --profile-top 25 "${SPECS[@]}" >>"$OUT/jj.jsonl" 2>>"$OUT/jj.log"
  say "jaxjob variants rc=$?"
fi
