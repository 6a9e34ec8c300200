#!/usr/bin/env bash
# Reproduce the SmolLM2-135M-Instruct drafter (assets/smollm2-135m-instruct/drafter) from scratch.
#
#   scripts/reproduce_smollm2.sh [--dry_run] [RUNS]      # from the repository root
#
# Stages (every one resumes: a finished chunk / stage is skipped, a chunk stopped mid-way
# continues from its finished batches (responses_i.jsonl.partial), training resumes from its
# last checkpoint, so the script can be stopped and rerun across sessions):
#   1. prompts:  ShareGPT's first user turns (python -m dflash_jax.data.sources), MT-Bench and
#                HumanEval checked absent
#   2. regen:    the target's greedy answers through its chat template, CHUNK conversations a
#                file (python -m dflash_jax.training.regenerate), CHUNKS chunks; a chunk
#                committed in assets/smollm2-135m-instruct/regen/ is unpacked, not redone
#   3. train:    train.py --config=configs/smollm2/drafter.py on the chunks written so far
#   4. export:   the drafter in bfloat16 to $OUT (default RUNS/drafter)
#   5. eval:     benchmarks/eval_tau.py on MT-Bench and HumanEval (greedy, block 16, 256 tokens)
# Environment: PYTHON (default python), CHUNKS (default 8), CHUNK (default 512), OUT, INIT
# (a drafter to continue from), EVAL_PROMPTS (rows per dataset, 0: all),
# STEPS (training steps, default from the config). --dry_run prints the commands only.
set -euo pipefail
cd "$(dirname "$0")/.."

DRY=0
if [[ "${1:-}" == "--dry_run" ]]; then DRY=1; shift; fi
if [[ $# -gt 1 || "${1:-}" == -* ]]; then
  echo "usage: scripts/reproduce_smollm2.sh [--dry_run] [RUNS]" >&2
  exit 2
fi
RUNS="${1:-runs/smollm2}"
OUT="${OUT:-$RUNS/drafter}"
PY="${PYTHON:-python}"
CHUNKS="${CHUNKS:-8}"
CHUNK="${CHUNK:-512}"
TARGET=smollm2-135m-instruct

step() {
  local done_path="$1"; shift
  if [[ $DRY == 1 ]]; then
    printf '%q ' "$@"; echo
  elif [[ -e "$done_path" ]]; then
    echo "reproduce: $done_path exists, skipping"
  else
    echo "reproduce: $*"
    "$@"
  fi
}

[[ $DRY == 1 ]] || mkdir -p "$RUNS/regen"
step "$RUNS/prompts.jsonl" "$PY" -m dflash_jax.data.sources --source=sharegpt \
  --out="$RUNS/prompts.jsonl" --max_turns=1 --max_chars=2000
for ((i = 0; i < CHUNKS; i++)); do
  part="$RUNS/regen/prompts_$i.jsonl"
  if [[ $DRY == 1 ]]; then
    echo "sed -n $((i * CHUNK + 1)),$(((i + 1) * CHUNK))p $RUNS/prompts.jsonl > $part"
  elif [[ ! -e "$part" ]]; then
    sed -n "$((i * CHUNK + 1)),$(((i + 1) * CHUNK))p" "$RUNS/prompts.jsonl" > "$part.tmp"
    mv "$part.tmp" "$part"
  fi
  shipped="assets/smollm2-135m-instruct/regen/responses_$i.jsonl.gz"
  if [[ $DRY == 0 && -e "$shipped" && ! -e "$RUNS/regen/responses_$i.jsonl" ]]; then
    # a chunk regenerated in an earlier session, committed (the same command's output)
    gunzip -c "$shipped" > "$RUNS/regen/responses_$i.jsonl.tmp"
    mv "$RUNS/regen/responses_$i.jsonl.tmp" "$RUNS/regen/responses_$i.jsonl"
  fi
  step "$RUNS/regen/responses_$i.jsonl" "$PY" -m dflash_jax.training.regenerate \
    --target=$TARGET --prompts="$part" --out="$RUNS/regen/responses_$i.jsonl" \
    --batch_size=64 --max_new_tokens=256
done

# Stage 3: train on every chunk written so far (concatenated in chunk order; the trainer holds
# out the last regen.holdout_fraction of the records for its in-loop loss and tau).
RESP="$RUNS/responses.jsonl"
if [[ $DRY == 1 ]]; then
  echo "cat $RUNS/regen/responses_*.jsonl > $RESP"
else
  files=()
  for ((i = 0; i < CHUNKS; i++)); do
    [[ -e "$RUNS/regen/responses_$i.jsonl" ]] && files+=("$RUNS/regen/responses_$i.jsonl")
  done
  cat "${files[@]}" > "$RESP.tmp" && mv "$RESP.tmp" "$RESP"
  echo "reproduce: ${#files[@]} chunks of responses -> $RESP"
fi
extra=()
[[ -n "${STEPS:-}" ]] && extra+=("--config.num_train_steps=$STEPS")
[[ -n "${INIT:-}" ]] && extra+=("--config.drafter.init_path=$INIT")
step "$RUNS/train/export/drafter/config.json" "$PY" train.py --config=configs/smollm2/drafter.py \
  --workdir="$RUNS/train" --config.regen.output="$RESP" "${extra[@]}"

# Stage 4: the drafter in bfloat16 (as shipped).
step "$OUT/config.json" "$PY" -c "import sys, dflash_jax as dj; t = dj.load_target(sys.argv[3]); \
dj.save_drafter(dj.load_drafter(sys.argv[1], target=t), sys.argv[2], dtype='bfloat16')" \
  "$RUNS/train/export/drafter" "$OUT" "$TARGET"

# Stage 5: tau on MT-Bench (both turns) and HumanEval, greedy, block 16, 256 new tokens
# (batched: tau and equality with autoregressive decoding; no timing on this CPU).
step "$RUNS/eval_t0_b16.json" "$PY" benchmarks/eval_tau.py --target=$TARGET --drafter="$OUT" \
  --datasets=mt_bench,humaneval --temperature=0 --max_new_tokens=256 --batch_size=16 \
  --num_prompts="${EVAL_PROMPTS:-0}" --json_out="$RUNS/eval_t0_b16.json" \
  --md_out="$RUNS/eval_t0_b16.md"
