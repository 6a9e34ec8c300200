#!/usr/bin/env bash
# Today's drafter-training pipeline against the one before issue #18 (commit 6f6ed52: per-row
# anchors, flax default init), on the same data, config and number of steps, both measured by
# today's benchmarks/bench_dflash.py on the same held-out prompts with the bundled target.
#
#   bash scripts/compare_recipes.sh [WORKDIR] [STEPS]      (defaults /tmp/recipe_compare, 800)
#
# 1. regenerates 4,096 greedy responses of the bundled target (configs/tiny_code/drafter.py's
#    prompt pool) once; 2. trains a drafter with each pipeline on them (the two runs in
#    parallel, ~25 min each on a busy 2-core CPU); 3. benchmarks both (block 16, greedy, batch 1)
#    into benchmarks/results/recipe_compare/{new,old}/. Resumable: finished steps are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
W=${1:-/tmp/recipe_compare}
STEPS=${2:-800}
PY=${PY:-.venv/bin/python}
ROOT=$(pwd)
export JAX_PLATFORMS=cpu
TARGET=$ROOT/assets/tiny-code/target
mkdir -p "$W/new" "$W/old"
if [ ! -f "$W/new/regenerated.jsonl" ]; then
    $PY train.py --config=configs/tiny_code/drafter.py --workdir="$W/new" \
        --config.target_path="$TARGET" --config.regen.num_prompts=4096 --config.regen.only=True
fi
cp -n "$W/new/regenerated.jsonl" "$W/old/regenerated.jsonl"
if [ ! -d "$W/old_code" ]; then
    git worktree add --detach "$W/old_code" 6f6ed52
fi
COMMON=(--config.num_train_steps="$STEPS" --config.eval_every=100000 --config.checkpoint_every=400)
$PY train.py --config=configs/tiny_code/drafter.py --workdir="$W/new" \
    --config.target_path="$TARGET" "${COMMON[@]}" > "$W/train_new.log" 2>&1 &
new_pid=$!
(cd "$W/old_code" && PYTHONPATH="$W/old_code" "$ROOT/$PY" train.py \
    --config="$W/old_code/configs/tiny_code_drafter.py" --workdir="$W/old" --config.target_path="$TARGET" \
    "${COMMON[@]}" > "$W/train_old.log" 2>&1) &
old_pid=$!
wait "$new_pid" || { tail -n 5 "$W/train_new.log"; exit 1; }
wait "$old_pid" || { tail -n 5 "$W/train_old.log"; exit 1; }
grep -a "^eval step" "$W/train_new.log" "$W/train_old.log"
for v in new old; do
    $PY benchmarks/bench_dflash.py --target="$TARGET" --drafter="$W/$v/export/drafter" \
        --out_dir=benchmarks/results/recipe_compare/$v --num_prompts=64 --max_new_tokens=64 \
        --block_sizes=16 --temperatures=0 --denoise_steps=1 --batch_sizes=1 --repeats=1
done
