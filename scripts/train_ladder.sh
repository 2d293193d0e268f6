#!/usr/bin/env bash
# The training ladder and the fused-norm comparison, each row one `python train.py` process on synthetic data
# (batch 256, 224px, 150 steps of one epoch, img/s as train.py reports it: images over time after its warm-up).
#
#   [PYTHON=python3] bash scripts/train_ladder.sh [ROUNDS]   # ROUNDS (default 2) alternating rounds of the comparison
#   bash scripts/train_ladder.sh | tee ladder.md && python scripts/plot_ladder.py ladder.md --out ladder.png
#
# Ladder: fp32 NCHW -> AMP fp16 -> channels_last -> custom depthwise -> custom BatchNorm+ReLU -> BatchNorm+ReLU in
# the depthwise kernels (norm.apply_in_depthwise) -> captured step -> BatchNorm+ReLU in cuDNN's pointwise convs
# (norm.apply_in_pointwise, where cudnn-frontend is installed) -> the next BatchNorms' statistics from cuDNN's sums
# (norm.stats_from_pointwise), each step adding one switch to the one before (the first six eager,
# cuda_graph=false). Then the comparison the
# fused-norm issue asks for, alternating processes: backend=custom norm=custom against backend=cudnn norm=torch
# (default capture), and backend=custom norm=apex where apex is installed, ROUNDS times; then the bf16 and fp32
# channels_last rows of norm=custom.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-2}
PY=${PYTHON:-python}  # the interpreter to run train.py with
COMMON="data=synthetic epochs=1 data.steps_per_epoch=150 evaluate=false save_checkpoints=false progress=false"

run() {  # label, overrides...
  local label=$1
  shift
  local img_s
  # `|| true`: a run that fails prints `failed` in its row instead of ending the ladder (set -e, pipefail).
  img_s=$("$PY" train.py $COMMON "$@" 2>&1 | sed -n 's/.*train img\/s (total) *│ *\([0-9,.]*\).*/\1/p' | head -1) || true
  printf '| %s | `%s` | %s |\n' "$label" "$*" "${img_s:-failed}"
}

echo "| step | overrides | train img/s |"
echo "|---|---|--:|"
run "fp32 NCHW" backend=torch amp=false channels_last=false cuda_graph=false
run "AMP fp16" backend=torch amp=true channels_last=false cuda_graph=false
run "channels_last" backend=torch amp=true channels_last=true cuda_graph=false
run "custom depthwise" backend=custom amp=true channels_last=true cuda_graph=false
run "custom BatchNorm+ReLU" backend=custom norm=custom norm.apply_in_depthwise=false norm.apply_in_pointwise=false \
  amp=true channels_last=true cuda_graph=false
run "BatchNorm+ReLU in the depthwise kernels" backend=custom norm=custom norm.apply_in_depthwise=true \
  norm.apply_in_pointwise=false amp=true channels_last=true cuda_graph=false
run "captured step" backend=custom norm=custom norm.apply_in_depthwise=true norm.apply_in_pointwise=false amp=true \
  channels_last=true cuda_graph=true
# The last steps where cudnn-frontend is importable (a dependency, so normally; the second is opt-in: sums that are
# not bitwise repeatable); otherwise their row says so under a label that is no step of the ladder.
if "$PY" -c "import cudnn" >/dev/null 2>&1; then
  run "BatchNorm+ReLU in cuDNN's pointwise convs" backend=custom norm=custom norm.apply_in_depthwise=true \
    norm.apply_in_pointwise=true amp=true channels_last=true cuda_graph=true
  run "statistics from cuDNN's sums (not bitwise repeatable)" backend=custom norm=custom \
    norm.apply_in_depthwise=true norm.apply_in_pointwise=true norm.stats_from_pointwise=true amp=true \
    channels_last=true cuda_graph=true
else
  printf '| %s | `%s` | not run: nvidia-cudnn-frontend is not installed (pip install "nvidia-cudnn-frontend>=1.16,<1.17") |\n' \
    "BatchNorm+ReLU in cuDNN's pointwise convs (not run)" "norm.apply_in_pointwise=true"
fi
# The apex peer (NVIDIA apex's NHWC BatchNorm with fused ReLU) joins the rounds where apex is importable; otherwise
# its row says so rather than disappearing.
APEX=0
"$PY" -c "from apex.contrib.groupbn import BatchNorm2d_NHWC" >/dev/null 2>&1 && APEX=1
for r in $(seq "$ROUNDS"); do
  run "round $r: custom + norm=custom" backend=custom norm=custom amp=true channels_last=true
  run "round $r: cudnn + norm=torch" backend=cudnn norm=torch amp=true channels_last=true
  if [ "$APEX" = 1 ]; then
    run "round $r: custom + norm=apex" backend=custom norm=apex amp=true channels_last=true
  fi
done
[ "$APEX" = 1 ] || printf '| custom + norm=apex | `backend=custom norm=apex` | not run: apex.contrib.groupbn is not importable |\n'
run "custom + norm=custom, bf16" backend=custom norm=custom amp=true amp_dtype=bf16 channels_last=true
run "custom + norm=custom, fp32" backend=custom norm=custom amp=false channels_last=true
