# Goodput on the TPU chip: how long a resume takes to its first step,
# and what periodic saves cost the steps. Qwen3-0.6B, seq 2,048 x 8 (bench/tpu/qwen3-0.6b-v5e.toml).
#   bash bench/tpu/goodput.sh [a] [b] [host]        (default: a b; about 6 minutes of chip time)
# From the repo root on the TPU machine, with .whl-tpu/ and .peers/ carried (see
# bench/tpu/device_setup.sh). Writes under $OUT: goodput.jsonl (one row per run, then the
# comparison of the two b runs; bench/tpu/goodput_run.py says what a row holds), one log per
# run, session.log.
#   a   a fresh run of 3 steps with its final save (empty compilation cache), then two resumes
#       of it, each stopped after its first step with no save: with the compilation cache the
#       fresh run filled, and with the cache off. Rows: ttfs_s (process start to the end of
#       the first step), the first_step event (restore_s, verify_s, compile_s,
#       restore_overlap_s, compile_from_cache) and the ledger.
#   b   two runs of 80 steps (about 63 s of steps at 0.79 s), stopped with no final save: one
#       without periodic saves, one saving every 38 steps (about 30 s; saves at 38 and 76).
#       Rows: every step's [step, step_time, elapsed] (log_every = 1) and the checkpoint
#       events (blocked_s; checkpoint_written: write_s and at_step, the step reached when the
#       write ended), then the comparison: throughput ratio and the steps during the writes.
#   host  bench/ckpt_host_cost.py on the chip: a 2 GiB state's save, plain and zstd, with the
#       loop's host work beside it (about 60 s).
set -u
OUT=${OUT:-/tmp/goodput-out}
mkdir -p "$OUT"
exec 3>>"$OUT/session.log"
say() { echo "[goodput $(date +%T)] $*" | tee /dev/fd/3 >&2; }
PHASES=" ${*:-a b} "
CFG=bench/tpu/qwen3-0.6b-v5e.toml
ROWS="$OUT/goodput.jsonl"

say "setup"
# shellcheck disable=SC1091
source bench/tpu/device_setup.sh || { say "jaxjob setup failed"; exit 2; }
python3 -c 'import platform, jax; print(platform.libc_ver(), jax.__version__, jax.devices())' >&3 2>&1
export JAXJOB_STARTUP_LOG=1
# The data once, before any timed start (the runs read runs/data/stdlib-byte).
if [ ! -f runs/data/stdlib-byte/manifest.json ]; then
  say "data prepare"
  rt data prepare --input '{stdlib}/**/*.py' --tokenizer byte --out runs/data/stdlib-byte \
    --max-bytes 16000000 >&3 2>&1 || { say "data prepare failed"; exit 2; }
fi
rm -rf runs/gp-a runs/gp-b1 runs/gp-b2
export JAX_COMPILATION_CACHE_DIR=/tmp/gp-xla
rm -rf "$JAX_COMPILATION_CACHE_DIR"

run() {  # run NAME RUN_ID STOP_AT_STEP|- TIMEOUT [runtime local args...]
  local name=$1 id=$2 stop=$3 timeout=$4
  shift 4
  local stopping=()
  [ "$stop" != "-" ] && stopping=(--stop-at-step "$stop")
  say "$name"
  python3 bench/tpu/goodput_run.py --what "$name" --run "runs/$id" "${stopping[@]}" \
    --timeout "$timeout" --log "$OUT/$name.log" -- "$CFG" --set "run.id=\"$id\"" "$@" >>"$ROWS"
  say "$name rc=$? $(tail -1 "$ROWS" | grep -o '"ttfs_s": [0-9.]*\|"ttfs_s": null')"
}

if [[ $PHASES == *" a "* ]]; then
  python3 -c 'import jax' >/dev/null 2>&1  # JAX's files in the page cache, as docs/performance.md's runs had
  run a1-fresh gp-a - 200 --max-steps 3
  run a2-resume-cached gp-a 4 150 --resume --set checkpoint.on_signal=false
  JAXJOB_COMPILATION_CACHE=0 JAX_COMPILATION_CACHE_DIR= \
    run a3-resume-uncached gp-a 4 150 --resume --set checkpoint.on_signal=false
fi

if [[ $PHASES == *" b "* ]]; then
  LONG=(--set training.target_tokens=3276800 --set checkpoint.on_signal=false)  # 200 steps
  run b1-no-saves gp-b1 80 200 "${LONG[@]}" --set checkpoint.every=0
  run b2-save-every-38 gp-b2 80 240 "${LONG[@]}" --set checkpoint.every=38
  python3 bench/tpu/goodput_run.py --compare "$ROWS" b1-no-saves b2-save-every-38 >>"$ROWS"
  say "compare: $(tail -1 "$ROWS" | cut -c1-400)"
fi

if [[ $PHASES == *" host "* ]]; then
  say "host cost"
  timeout 200 python3 bench/ckpt_host_cost.py --mb 2048 --variants plain,zstd \
    --dir /tmp/gp-host-cost >>"$ROWS" 2>>"$OUT/host.log"
  say "host cost rc=$?"
fi
say "done"
