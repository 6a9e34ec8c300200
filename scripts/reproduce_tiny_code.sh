#!/usr/bin/env bash
# Reproduce the bundled tiny-code pair (assets/tiny-code/) from scratch, then benchmark it.
#
#   scripts/reproduce_tiny_code.sh [--dry_run] [RUNS]      # from the repository root
#
# The chain of configs/tiny_code/ (the story and the figures: assets/tiny-code/README.md):
#   targets:  target (stage 1) -> target_stage2 -> target_unlikelihood (the bundled target)
#   drafters: drafter (on the stage-1 target) -> drafter_stage2 (stage-2 target)
#             -> drafter_stage3 (twice the responses) -> drafter_stage4 (the bundled drafter,
#             on 32,768 responses of the bundled target) -> drafter_ddpm / drafter_ddpm_control
#             (issue 31: multi-pass denoising, and its control)
#   export:   both in bfloat16 to $OUT (default RUNS/pair), then benchmarks/bench_dflash.py
#             into RUNS/bench (the command that made benchmarks/results/tiny-code/results.md).
# RUNS (default runs/tiny_code) holds every stage's workdir. About 5.5 hours on an otherwise
# idle 2-core CPU. Rerunning the script resumes: a stage whose export (or responses file)
# exists is skipped, an interrupted one resumes from its last checkpoint.
# Environment: PYTHON (default python), OUT (default RUNS/pair; OUT=assets/tiny-code replaces
# the bundled pair). --dry_run prints the commands and runs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

DRY=0
if [[ "${1:-}" == "--dry_run" ]]; then DRY=1; shift; fi
if [[ $# -gt 1 || "${1:-}" == -* ]]; then
  echo "usage: scripts/reproduce_tiny_code.sh [--dry_run] [RUNS]" >&2
  exit 2
fi
RUNS="${1:-runs/tiny_code}"
OUT="${OUT:-$RUNS/pair}"
PY="${PYTHON:-python}"
C=configs/tiny_code

# step DONE_PATH CMD...: run CMD unless DONE_PATH exists (or only print it with --dry_run).
step() {
  local done_path="$1"; shift
  if [[ $DRY == 1 ]]; then
    printf '%q ' "$@"; echo
  elif [[ -e "$done_path" ]]; then
    echo "reproduce: $done_path exists, skipping: $*"
  else
    echo "reproduce: $*"
    "$@"
  fi
}

# to_bf16 KIND SRC DST [TARGET]: a float32 export written back in bfloat16 (as bundled).
to_bf16() {
  local kind="$1" src="$2" dst="$3" tgt="${4:-}"
  if [[ $kind == target ]]; then
    step "$dst/config.json" "$PY" -c "import sys, dflash_jax as dj; \
dj.save_target(dj.load_target(sys.argv[1]), sys.argv[2], dtype='bfloat16')" "$src" "$dst"
  else
    step "$dst/config.json" "$PY" -c "import sys, dflash_jax as dj; t = dj.load_target(sys.argv[3]); \
dj.save_drafter(dj.load_drafter(sys.argv[1], target=t), sys.argv[2], dtype='bfloat16')" \
      "$src" "$dst" "$tgt"
  fi
}

# concat DST SRC...: the responses of several regeneration runs as one file (written atomically).
concat() {
  local dst="$1"; shift
  if [[ $DRY == 1 ]]; then
    echo "cat $* > $dst"
  elif [[ ! -e "$dst" ]]; then
    cat "$@" > "$dst.tmp" && mv "$dst.tmp" "$dst"
  fi
}

[[ $DRY == 1 ]] || mkdir -p "$RUNS"

# Targets (~40 + ~50 + ~33 min).
step "$RUNS/target1/export/target" "$PY" train.py --config=$C/target.py --workdir="$RUNS/target1"
step "$RUNS/target2/export/target" "$PY" train.py --config=$C/target_stage2.py \
  --workdir="$RUNS/target2" --config.target_path="$RUNS/target1/export/target"
step "$RUNS/target_ul/export/target" "$PY" train.py --config=$C/target_unlikelihood.py \
  --workdir="$RUNS/target_ul" --config.target_path="$RUNS/target2/export/target"
to_bf16 target "$RUNS/target1/export/target" "$RUNS/target1/bf16"
to_bf16 target "$RUNS/target2/export/target" "$RUNS/target2/bf16"
to_bf16 target "$RUNS/target_ul/export/target" "$OUT/target"

# Drafters. Stage 1 on the stage-1 target (~15 min regeneration + ~40 min).
step "$RUNS/drafter1/export/drafter" "$PY" train.py --config=$C/drafter.py \
  --workdir="$RUNS/drafter1" --config.target_path="$RUNS/target1/bf16"
# Stage 2 on the stage-2 target (~14 + ~31 min).
step "$RUNS/drafter2/export/drafter" "$PY" train.py --config=$C/drafter_stage2.py \
  --workdir="$RUNS/drafter2" --config.target_path="$RUNS/target2/bf16" --config.drafter.init_path="$RUNS/drafter1/export/drafter"
# Stage 3: 16,384 more responses of the stage-2 target (seed 1, ~17 min), then all 32,768 (~25 min).
step "$RUNS/regen_seed1.jsonl" "$PY" train.py --config=$C/drafter_stage2.py \
  --workdir="$RUNS/regen_seed1" --config.target_path="$RUNS/target2/bf16" --config.seed=1 \
  --config.drafter.init_path="$RUNS/drafter2/export/drafter" --config.regen.output="$RUNS/regen_seed1.jsonl" \
  --config.regen.only=True
concat "$RUNS/regen_32k.jsonl" "$RUNS/drafter2/regenerated.jsonl" "$RUNS/regen_seed1.jsonl"
step "$RUNS/drafter3/export/drafter" "$PY" train.py --config=$C/drafter_stage3.py \
  --workdir="$RUNS/drafter3" --config.target_path="$RUNS/target2/bf16" --config.drafter.init_path="$RUNS/drafter2/export/drafter" \
  --config.regen.output="$RUNS/regen_32k.jsonl"
# Stage 4: 32,768 responses of the bundled target (seeds 0 and 1, ~15 min each), 3000 steps (~20 min).
for seed in 0 1; do
  step "$RUNS/regen_ul_$seed.jsonl" "$PY" train.py --config=$C/drafter_stage3.py \
    --workdir="$RUNS/regen_ul_$seed" --config.target_path="$OUT/target" --config.seed=$seed \
    --config.drafter.init_path="$RUNS/drafter3/export/drafter" --config.regen.output="$RUNS/regen_ul_$seed.jsonl" \
    --config.regen.only=True
done
concat "$RUNS/regen_ul_32k.jsonl" "$RUNS/regen_ul_0.jsonl" "$RUNS/regen_ul_1.jsonl"
step "$RUNS/drafter4/export/drafter" "$PY" train.py --config=$C/drafter_stage4.py \
  --workdir="$RUNS/drafter4" --config.target_path="$OUT/target" --config.drafter.init_path="$RUNS/drafter3/export/drafter" \
  --config.regen.output="$RUNS/regen_ul_32k.jsonl"
to_bf16 drafter "$RUNS/drafter4/export/drafter" "$OUT/drafter" "$OUT/target"
# The multi-pass denoising drafter (issue 31): 8192 responses of the bundled target (seed 2,
# ~12 min), then the mixture objective and its fully masked control, 1500 steps each from the
# bundled drafter (~30 min each), one after the other.
step "$RUNS/regen_s2.jsonl" "$PY" train.py --config=$C/drafter_stage4.py \
  --workdir="$RUNS/regen_s2" --config.target_path="$OUT/target" --config.seed=2 \
  --config.drafter.init_path="$OUT/drafter" --config.regen.output="$RUNS/regen_s2.jsonl" \
  --config.regen.only=True --config.regen.num_prompts=8192
for run in ddpm ddpm_control; do
  step "$RUNS/$run/export/drafter" "$PY" train.py --config=$C/drafter_$run.py \
    --workdir="$RUNS/$run" --config.target_path="$OUT/target" --config.drafter.init_path="$OUT/drafter" \
    --config.regen.output="$RUNS/regen_s2.jsonl"
done
to_bf16 drafter "$RUNS/ddpm/export/drafter" "$OUT/drafter_ddpm" "$OUT/target"

# The benchmark of assets/tiny-code/README.md (~15 min).
step "$RUNS/bench/results.md" "$PY" benchmarks/bench_dflash.py --target="$OUT/target" \
  --drafter="$OUT/drafter" --out_dir="$RUNS/bench" --num_prompts=100 --max_new_tokens=64 \
  --repeats=3
[[ $DRY == 1 ]] || echo "reproduce: the pair is in $OUT, its benchmark in $RUNS/bench/results.md"
