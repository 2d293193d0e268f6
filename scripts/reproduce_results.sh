#!/usr/bin/env bash
# Re-measure every table in docs/results/ on this machine's GPU, writing into OUT (default docs/results).
# Each step is one of the project's own commands; run a subset with STEPS="overhead loss profile" etc.
# Needs a CUDA GPU; DALI steps need nvidia-dali and a dataset (make_fake_imagenet.py writes one); scaling needs 2+ GPUs.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-docs/results}
STEPS=${STEPS:-"tests depthwise overhead loss profile inference-ab graph norm-backward matrix loader dali-train scaling"}
FAKE=${FAKE:-/tmp/fake-imagenet}
mkdir -p "$OUT"
has() { [[ " $STEPS " == *" $1 "* ]]; }

has tests && python -m pytest -q -m gpu 2>&1 | tail -5 | tee "$OUT/gpu_tests.log"
if has depthwise; then
  python scripts/bench_depthwise.py --repeats 10 --out "$OUT/depthwise_h200"
  # The layers as the model runs them: each input written by a producer kernel just before (docs/kernel_notes.md, v9).
  python scripts/bench_depthwise.py --dtypes fp16,bf16 --layouts nhwc --backends cudnn,custom --modes fwd,fwdbwd --repeats 10 --l2 warm --out "$OUT/depthwise_h200_l2warm"
  # The deeper 16-bit stride-1 forward (MDW_FWD_COLUMN_DEEP, the default since 2026-12-02; docs/kernel_notes.md, FWD_COLUMN_DEEP).
  for l2 in warm cold; do
    MDW_FWD_COLUMN_DEEP=1 python scripts/bench_depthwise.py --dtypes fp16,bf16 --layouts nhwc --backends cudnn,custom --modes fwd --repeats 10 --l2 $l2 --out "$OUT/depthwise_h200_fwd_column_deep_${l2/warm/l2warm}"
  done
  # The column walks' defaults of 2026-12-02 against the settings before them (docs/kernels.md, "The column walks' defaults").
  for suite in mobilenet_v1 efficientnet_b0 mobilenet_v3; do
    name=$([ $suite = mobilenet_v1 ] && echo depthwise_h200 || echo depthwise_${suite}_h200)_nhwc_column_defaults
    python scripts/bench_depthwise.py --suite $suite --backends cudnn,custom --layouts nhwc --dtypes fp32,fp16,bf16 --modes fwd,fwdbwd --repeats 5 --ab MDW_FWD_COLUMN_DEEP=0,MDW_DGRAD_COLUMN_ROWS=1,MDW_COLUMN_SECTORS=0 --out "$OUT/$name"
  done
  # The walks' prefetch switches against their other setting (docs/kernels.md): the 5x5/7x7 ones (on by default) ...
  for suite in convnext_t efficientnet_b0 large_k7; do
    python scripts/bench_depthwise.py --suite $suite --backends torch,cudnn,custom --layouts nchw --dtypes fp32,fp16,bf16 --modes fwd --repeats 5 --ab MDW_NCHW_COLUMN_K57_PREFETCH=0 --out "$OUT/depthwise_${suite}_h200_nchw_prefetch_ab"
  done
  python scripts/bench_depthwise.py --suite convnext_t --backends cudnn,custom --layouts nhwc --dtypes fp32,fp16,bf16 --modes fwd --repeats 3 --ab MDW_FWD_COLUMN_K57_PREFETCH=0 --out "$OUT/depthwise_convnext_t_h200_nhwc_prefetch_ab"
  # ... and the 3x3 one (off by default: measured slower)
  python scripts/bench_depthwise.py --suite mobilenet_v1 --backends cudnn,custom --layouts nhwc --dtypes fp32,fp16,bf16 --modes fwd,fwdbwd --repeats 5 --ab MDW_FWD_COLUMN_PREFETCH=1 --out "$OUT/depthwise_h200_nhwc_prefetch3_ab"
  for suite in mobilenet_v1 efficientnet_b0 mobilenet_v3 convnext_t; do
    python scripts/experiments/depthwise_precision.py --suite $suite --dtype fp16 --layout nhwc | tee "$OUT/depthwise_precision_${suite}_fp16.md"
  done
fi
has overhead && python scripts/check_engine_overhead.py --steps 300 --warmup 40 --rounds 3 --out "$OUT/engine_overhead_h200.md" || true
has loss && python scripts/compare_loss_curves.py --backends custom,cudnn --steps 100 --out "$OUT/loss_curves_custom_vs_cudnn.md" || true
if has profile; then
  python infer.py --profile backend=cudnn amp=true channels_last=false > "$OUT/profile_infer_cudnn_amp_nchw.txt" 2>&1
  python infer.py --profile backend=cudnn amp=true channels_last=true > "$OUT/profile_infer_cudnn_amp_cl.txt" 2>&1
  python train.py profile=true backend=custom amp=true channels_last=true data=synthetic > "$OUT/profile_train_custom_amp_cl.txt" 2>&1
fi
if has inference-ab; then
  # fp16 channels_last inference, custom vs cudnn in one process, with and without COLUMN_REVERSE (docs/kernel_notes.md, v8).
  for r in 1 2 3; do for rev in 0 1; do
    MDW_COLUMN_REVERSE=$rev python scripts/inference_ab.py | tee "$OUT/inference_ab_rev${rev}_r$r.txt"
  done; done
  # ... and with one output row per lane everywhere (1) against the default, two on short stride-1 rows (0: auto; v9).
  for r in 1 2 3; do for rows in 1 0; do
    MDW_FWD_COLUMN_ROWS_F16=$rows MDW_FWD_COLUMN_ROWS_BF16=$rows python scripts/inference_ab.py | tee "$OUT/inference_ab_rows${rows}_r$r.txt"
  done; done
  # ... and with the deeper 16-bit stride-1 forward (1) against the default (0) (docs/kernel_notes.md, FWD_COLUMN_DEEP).
  for r in 1 2; do for deep in 0 1; do
    MDW_FWD_COLUMN_DEEP=$deep python scripts/inference_ab.py | tee "$OUT/inference_ab_deep${deep}_r$r.txt"
  done; done
  python infer.py --profile backend=custom amp=true channels_last=true > "$OUT/profile_infer_custom_amp_cl.txt" 2>&1
fi
if has graph; then
  # Eager vs the captured training step (docs/results/cuda_graph_h200.md), two alternating rounds.
  common="data=synthetic amp=true channels_last=true epochs=1 data.steps_per_epoch=150 evaluate=false save_checkpoints=false progress=false"
  for round in 1 2; do for be in cudnn custom; do for graph in true false; do
    python train.py backend=$be cuda_graph=$graph $common 2>&1 | grep -E "train img/s \(total\)|CUDA graph" | tee "$OUT/graph_${be}_${graph}_r$round.txt"
  done; done; done
fi
if has norm-backward; then
  # norm.apply_in_depthwise's backward: the walk with the BatchNorm's sums (the default), the walk alone and the
  # separate passes, alternating, with cudnn + torch in the same rounds (docs/results/train_norm_h200.md).
  common="data=synthetic amp=true channels_last=true epochs=1 data.steps_per_epoch=150 evaluate=false save_checkpoints=false progress=false"
  for round in 1 2; do
    for mode in sums walk separate; do
      MBN_DEPTHWISE_BACKWARD=$mode python train.py backend=custom norm=custom $common 2>&1 | grep -E "train img/s \(total\)" | tee "$OUT/norm_backward_${mode}_r$round.txt"
    done
    python train.py backend=cudnn norm=torch $common 2>&1 | grep -E "train img/s \(total\)" | tee "$OUT/norm_backward_cudnn_torch_r$round.txt"
  done
fi
if has matrix; then
  # The full synthetic matrix (both compile settings, eager and captured steps, the timm peer); rerun the same line to continue after a stop.
  python scripts/benchmark.py --data synthetic --peer yes --cuda-graph false,true --out "$OUT/matrix_h200_runs"
  python scripts/compare.py "$OUT/matrix_h200_runs" --out "$OUT" --name matrix_h200
  # Compiled training varies by several percent between processes: its custom/cudnn channels_last pairs in 3 rounds.
  python scripts/benchmark.py --data synthetic --peer no --compile true --channels-last true --backends cudnn,custom --repeats 3 --out "$OUT/matrix_h200_compiled_repeats"
  python scripts/compare.py "$OUT/matrix_h200_compiled_repeats" --out "$OUT" --name matrix_h200_compiled_repeats
fi
if has loader || has dali-train; then
  [[ -d "$FAKE/train" ]] || python scripts/make_fake_imagenet.py --out "$FAKE" --num 20000 --val-fraction 0.05
fi
has loader && python scripts/bench_loader.py --root "$FAKE" --threads "$(nproc)" --out "$OUT/loader_h200.md"
if has dali-train; then
  # The DALI acceptance: the default fast step fed by DALI and by synthetic data, alternating (exit 1 below 0.90).
  python scripts/check_loader.py --rounds 2 --epochs 2 --out "$OUT/check_loader_dali_h200.md" data=dali \
    data.root="$FAKE" backend=custom norm=custom amp=true channels_last=true || true
  common="backend=cudnn amp=true channels_last=true epochs=2 data.steps_per_epoch=200 evaluate=false save_checkpoints=false progress=false"
  # What 32 hardware work queues buy (perf.max_connections=auto picks them for data=dali), captured and eager.
  python train.py data=dali data.root="$FAKE" perf.max_connections=8 cuda_graph=true $common 2>&1 | grep -E "img/s|data wait" | tee "$OUT/dali_train_8_queues_captured.txt"
  python train.py data=dali data.root="$FAKE" perf.max_connections=8 cuda_graph=false $common 2>&1 | grep -E "img/s|data wait" | tee "$OUT/dali_train_8_queues_eager.txt"
  python train.py data=dali data.root="$FAKE" cuda_graph=false $common 2>&1 | grep -E "img/s|data wait" | tee "$OUT/dali_train_eager.txt"
  # What the dedicated stream buys (perf.stream=auto picks it for data=dali): the same DALI run on the default stream.
  python train.py data=dali data.root="$FAKE" perf.stream=default $common 2>&1 | grep -E "img/s|data wait" | tee "$OUT/dali_train_default_stream.txt"
  # What the high priority buys (perf.stream_priority=auto picks it for data=dali): the same stream at normal priority.
  python train.py data=dali data.root="$FAKE" perf.stream_priority=normal $common 2>&1 | grep -E "img/s|data wait" | tee "$OUT/dali_train_normal_priority.txt"
fi
if has scaling; then
  # The DDP acceptance: 1 GPU vs torchrun on 2, same config, back to back (the script sets NCCL_NVLS_ENABLE=0).
  ngpu=$(python -c "import torch; print(torch.cuda.device_count())")
  if (( ngpu > 1 )); then
    python scripts/check_scaling.py --gpus 2 --rounds 3 --out "$OUT/ddp_scaling_2xh200.md" || true
  else
    echo "scaling: skipped, $ngpu GPU(s) visible (needs 2 or more)"
  fi
fi
