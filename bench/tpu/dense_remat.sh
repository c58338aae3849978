# Issue 37, goals 2 and 6 on the TPU v5e chip: the remat policies that keep the splash kernel's
# outputs against remat full (Qwen3-0.6B, 16,384 tokens a step), and 32,768 tokens of context.
#   [AUTO_SHAPES=...] [MT_SHAPES=...] bash bench/tpu/dense_remat.sh [shapes] [long] [local] [auto]
#     [maxtext]   (no argument: the first three)
# From the repo root on the TPU machine, with .whl-tpu/ and .peers/ carried (see
# bench/tpu/device_setup.sh); under 8 minutes of chip time (each phase has its own timeout:
# 3 x 85 s, 115 s, 90 s). Writes under $OUT:
#   session.log     what ran, when, and each phase's exit status
#   shapes.jsonl    bench/accel_step.py rows: 2,048 x 8, 4,096 x 4, 8,192 x 2, remat full,
#                   attention, and attention with bf16 logits (memory_analysis of the step
#                   compiled on the chip, tokens/s, MFU)
#                   ("auto": the defaults at AUTO_SHAPES, default 1,024 x 16, in the same file)
#   maxtext.log     MaxText's defaults (run_tpu.sh) at MT_SHAPES (default 2,048 x 8): its
#                   MAXTEXT_TPU_JSON lines
#   long.jsonl      accel_step rows at 32,768 x 1: remat attention_host and full (the defaults)
#   local.log       `runtime local` at 32,768 x 1 with the defaults, 4 steps: its output, and the
#                   TPU runtime's lines about the memory it reserves for the program
#   local-train.jsonl, local-events.jsonl   that run's metrics rows (tokens/s) and events
#   err.log         the accel_step phases' stderr (the data prepare's output goes to session.log);
#                   8 files at most: what the device tool returns
set -u
OUT=${OUT:-/tmp/dense-remat-out}
mkdir -p "$OUT"
exec 3>>"$OUT/session.log"
say() { echo "[dense $(date +%T)] $*" | tee /dev/fd/3 >&2; }
PHASES=" ${*:-shapes long local} "
MACHINE_PYTHONPATH=${PYTHONPATH:-}
MODEL=configs/models/qwen3-0.6b.toml

say "setup"
# shellcheck disable=SC1091
source bench/tpu/device_setup.sh || { say "jaxjob setup failed"; exit 2; }

if [[ $PHASES == *" shapes "* ]]; then
  # One process a shape (both variants in it, compared under the same conditions): a shape
  # that runs long costs only its own rows.
  for shape in 2048x8 4096x4 8192x2; do
    say "shapes: $shape, remat full vs attention, then attention with bf16 logits"
    timeout 125 python3 bench/accel_step.py --model "$MODEL" --shapes "$shape" --steps 6 \
      --variant "full:model.remat=full" --variant "attention:model.remat=attention" \
      --variant "attention_bf16:model.remat=attention;training.logits_dtype=bfloat16" \
      >>"$OUT/shapes.jsonl" 2>>"$OUT/err.log"
    say "shapes $shape rc=$?"
  done
fi

if [[ $PHASES == *" long "* ]]; then
  # attention_host first: the defaults' 32,768 x 1 also runs in the `local` phase.
  say "long: 32,768 x 1, remat attention_host vs full"
  timeout 115 python3 bench/accel_step.py --model "$MODEL" --shapes 32768x1 --steps 3 \
    --variant "attention_host:model.remat=attention_host" \
    --variant "full:model.remat=full" \
    >>"$OUT/long.jsonl" 2>>"$OUT/err.log"
  say "long rc=$?"
fi

if [[ $PHASES == *" local "* ]]; then
  DATA=/tmp/dense-data
  if [ ! -f $DATA/manifest.json ]; then
    say "local: preparing 4 MB of the stdlib as bytes"
    rt data prepare --input '{stdlib}/**/*.py' --tokenizer byte --out $DATA \
      --max-bytes 4000000 >&3 2>&1
  fi
  RUNS=/dev/shm/dense-runs
  rm -rf "$RUNS"
  say "local: runtime local, 32,768 x 1, the defaults, 4 steps"
  # The run (and its final checkpoint, 6.7 GB) in memory: the disk would take ~26 s to write it.
  timeout 90 python3 -c 'from runtime.commands.cli import main; main()' local \
    bench/tpu/qwen3-0.6b-v5e.toml --set run.id=qwen3-32k --set run.output_uri=$RUNS \
    --set data.manifest=$DATA/manifest.json --set training.seq_len=32768 \
    --set training.global_batch_size=1 --set training.target_tokens=131072 \
    --set checkpoint.every=0 >"$OUT/local.all" 2>&1
  say "local rc=$?"
  grep -v -E "^(W|I)[0-9]{4} " "$OUT/local.all" | tail -40 >"$OUT/local.log"
  grep -i -E "reserv|exceeds|RESOURCE_EXHAUSTED" "$OUT/local.all" | head -10 >>"$OUT/local.log"
  rm -f "$OUT/local.all"
  cp "$RUNS/qwen3-32k/metrics/train.jsonl" "$OUT/local-train.jsonl" 2>/dev/null
  cp "$RUNS/qwen3-32k/events.jsonl" "$OUT/local-events.jsonl" 2>/dev/null
  rm -rf "$RUNS"
fi
if [[ $PHASES == *" auto "* ]]; then
  # The defaults (remat "auto") at each of AUTO_SHAPES, one process.
  say "auto: ${AUTO_SHAPES:=1024x16}, the defaults"
  timeout 125 python3 bench/accel_step.py --model "$MODEL" --shapes "${AUTO_SHAPES// /,}" \
    --steps 6 >>"$OUT/shapes.jsonl" 2>>"$OUT/err.log"
  say "auto rc=$?"
fi

if [[ $PHASES == *" maxtext "* ]]; then
  # MaxText's defaults (run_tpu.sh) at each of MT_SHAPES (seq x per-device batch).
  for shape in ${MT_SHAPES:-2048x8}; do
    say "maxtext: run_tpu.sh defaults, $shape"
    (
      export PYTHONPATH=$MACHINE_PYTHONPATH
      cd .peers && timeout 170 env KEEP_SITE=1 STEPS=20 MTRUN=/tmp/mtrun OOM_RETRY=0 \
        PER_DEVICE_BATCH_SIZE="${shape#*x}" MAX_TARGET_LENGTH="${shape%x*}" \
        bash maxtext-tpu/run_tpu.sh
    ) >"$OUT/maxtext.all" 2>&1
    say "maxtext $shape rc=$? $(grep -h MAXTEXT_TPU_JSON "$OUT/maxtext.all" | cut -c1-300)"
    grep -E "MAXTEXT_TPU_JSON" "$OUT/maxtext.all" >>"$OUT/maxtext.log"
    grep -E "RESOURCE_EXHAUSTED" "$OUT/maxtext.all" | head -3 >>"$OUT/maxtext.log"
    rm -f "$OUT/maxtext.all"
  done
fi
for f in "$OUT"/err.log; do [ -f "$f" ] && tail -30 "$f" >"$f.tail" && mv "$f.tail" "$f"; done
say "done"
