#!/usr/bin/env bash
# Correctness and precision checks on the GPUs of this machine
# (docs/benchmarks.md "Test suite on GPUs", "Checkpoints and mixed
# precision"); run from the repository root; writes logs and JSON under
# ${OUT:-/tmp/gpu_checks}:
#   suite   the test suite on the GPUs present, compiled kernels
#   resume  gpt2-small: 100 steps straight (saving at 50) vs 50 + resumed 50
#           (bitwise only with XLA_FLAGS=--xla_gpu_deterministic_ops=true:
#           docs/benchmarks.md)
#   bf16    gpt2-small: float32 vs bfloat16 gradients (float32 / bfloat16
#           residual), onebit_adamw, equal steps, step times
#   kernels the kernel tests with the compiled kernels, then the one-GPU
#           overhead of a `single` plan (dgc, topk) and the sparse step's
#           kernels per source line (kernel_sources.py); one GPU, about
#           5 minutes; also whether Triton and XLA round 1-bit Adam's
#           stream β·m + (1 − β)·g alike (blend_probe.py). CHUNKS="4 1 0"
#           runs dgc with each rows-per-chunk of
#           the fused pass's streams (overhead.py --rows-per-chunk; about
#           2 minutes more each)
#   variants  kernel variants, each row against its own dense step: the
#           k-th largests as one Pallas kernel (overhead.py --radix pallas)
#           or XLA rounds (--radix radix), the scan folded into pass 2
#           (--scan-blocks 4096) or a kernel of its own (0); their tests
#           compiled and kth_rows.py, then the ROWS (default "dgc:base
#           dgc:old topk:base topk:old"; estimator:variant with variant
#           base = today's defaults, radix, scan, both = the Pallas radix
#           and/or the folded scan, batch / bucket = the fused pass per
#           batch / one per bucket, old = XLA rounds and the scan kernel);
#           one GPU, about 8 minutes; [steps] as in kernels. TESTS=0 skips
#           the tests and kth_rows.py
# usage: bash benchmarks/gpu_checks.sh suite|resume|bf16|kernels|variants [steps]
# PACK=FILE.tar.gz packs everything written into one archive at the end (a
# device call hands back only a few files: OUT=/tmp/k PACK=$OUT/k.tar.gz).
set -uo pipefail
out="${OUT:-/tmp/gpu_checks}"; mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
lm() { python examples/train_lm.py --preset gpt2-small "$@"; }
gpu_tests() {  # log name, test files...: compiled kernels on the GPUs
  local log=$1; shift
  JAX_PLATFORMS=cuda,cpu JAXFUSE_TEST_GPU=1 JAXFUSE_KERNELS=pallas \
    python -m pytest -q -p no:cacheprovider -rfEs "$@" > "$out/$log.log" 2>&1
  echo "$log rc=$?"; tail -n 3 "$out/$log.log"
}
logged() {  # name, lines of its log to show, command...
  local name=$1 lines=$2; shift 2
  "$@" > "$out/$name.log" 2>&1
  echo "$name rc=$?"; tail -n "$lines" "$out/$name.log"
}
overhead() {  # name, estimator, overhead.py args...: the run, its kernels
  local name=$1 e=$2; shift 2
  python benchmarks/overhead.py --preset gpt2-small --estimators "$e" \
    --strategy single "$@" --hlo-dir "$out/hlo_$name" \
    --out "$out/overhead_$name.json" > "$out/overhead_$name.log" 2>&1
  echo "$name rc=$?"; tail -n 3 "$out/overhead_$name.log"
  python benchmarks/kernel_sources.py "$out/hlo_$name/dense_None.hlo.txt" \
    "$out/hlo_$name/jaxfuse_$e.hlo.txt" --overhead "$out/overhead_$name.json" \
    --top 30 --out "$out/kernel_sources_$name.json" \
    > "$out/kernel_sources_$name.txt" 2>&1
}
case "$1" in
  suite)
    JAX_PLATFORMS=cuda,cpu JAXFUSE_TEST_GPU=1 JAXFUSE_KERNELS=pallas \
      python -m pytest tests -q -p no:cacheprovider -rfEs --durations=10 \
      > "$out/suite.log" 2>&1
    echo "suite rc=$?"; tail -n 30 "$out/suite.log" ;;
  resume)
    ck="$(mktemp -d)"
    common=(--steps "${2:-100}" --optimizer local_adamw --strategy aligned
            --eval-batches 2 --log-every 10 --checkpoint-dir "$ck")
    lm "${common[@]}" --checkpoint-every $(( ${2:-100} / 2 )) \
      --json-out "$out/resume_straight.json" > "$out/resume_straight.log" 2>&1
    rm -rf "$ck/${2:-100}"
    lm "${common[@]}" --resume --json-out "$out/resume_resumed.json" \
      > "$out/resume_resumed.log" 2>&1
    python - "$out" <<'PY'
import json, sys
a = json.load(open(f"{sys.argv[1]}/resume_straight.json"))
b = json.load(open(f"{sys.argv[1]}/resume_resumed.json"))
s = b["start_step"]
print("resumed from", s, "losses equal:", a["losses"][s:] == b["losses"],
      "val equal:", a["final_val_loss"] == b["final_val_loss"],
      a["final_val_loss"], b["final_val_loss"])
PY
    ;;
  bf16)
    steps="${2:-300}"
    common=(--steps "$steps" --optimizer onebit_adamw --dense-warmup $((steps / 6))
            --warmup-steps 0 --strategy aligned --dense-wire gradient
            --eval-batches 8 --log-every 50)
    for run in "f32 --grad-dtype float32" "bf16 --grad-dtype bfloat16" \
               "bf16_res16 --grad-dtype bfloat16 --residual-dtype gradient" \
               "dense_f32 --sync dense --grad-dtype float32" \
               "dense_bf16 --sync dense --grad-dtype bfloat16"; do
      set -- $run
      name="$1"; shift
      lm "${common[@]}" "$@" --json-out "$out/bf16_$name.json" \
        > "$out/bf16_$name.log" 2>&1
      grep summary "$out/bf16_$name.log" | sed "s/^/$name: /"
    done ;;
  kernels)
    gpu_tests kernel_tests tests/test_kernels_hash.py tests/test_zen.py \
      tests/test_kernels_select.py tests/test_kernels_fused_pass.py \
      tests/test_kernels_backend.py tests/test_grouped.py \
      tests/test_kernels_radix.py tests/test_kernels_segments.py
    logged blend_probe 5 python benchmarks/blend_probe.py \
      --out "$out/blend_probe.json"
    runs=""                      # one estimator per process, as published
    for c in ${CHUNKS:-default}; do runs="$runs dgc:$c"; done
    for run in $runs topk; do
      e=${run%%:*}; c=${run#*:}; [ "$c" = "$run" ] && c=default
      name=$e; extra=()
      if [ "$c" != default ]; then name="${e}_chunk$c"; extra=(--rows-per-chunk "$c"); fi
      overhead "$name" "$e" --steps "${2:-60}" "${extra[@]}"
    done ;;
  variants)
    steps="${2:-60}"
    if [ "${TESTS:-1}" = 1 ]; then
      gpu_tests variant_tests tests/test_kernels_radix.py \
        tests/test_radix_select.py tests/test_kernels_fused_pass.py \
        tests/test_kernels_segments.py
      logged kth_rows 8 python benchmarks/kth_rows.py --out "$out/kth_rows.json"
    fi
    for row in ${ROWS:-dgc:base dgc:old topk:base topk:old}; do
      e=${row%%:*}; v=${row#*:}
      case "$v" in
        base) extra=() ;;
        radix) extra=(--radix pallas) ;;
        scan) extra=(--scan-blocks 4096) ;;
        both) extra=(--radix pallas --scan-blocks 4096) ;;
        old) extra=(--radix radix --scan-blocks 0 --pass-per batch) ;;
        batch) extra=(--pass-per batch) ;;
        bucket) extra=(--pass-per bucket) ;;
        *) echo "unknown variant $v (base, radix, scan, both, old, batch, bucket)"; exit 2 ;;
      esac
      overhead "${e}_$v" "$e" --steps "$steps" "${extra[@]}"
    done ;;
esac
if [ -n "${PACK:-}" ]; then tar -czf "$PACK" -C "$out" . && echo "packed $PACK"; fi
