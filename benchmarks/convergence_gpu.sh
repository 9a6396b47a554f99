#!/usr/bin/env bash
# gpt2-small to 1000 steps on 2 GPUs of one host, dense against the README
# recipe (docs/convergence.md, 2 x H200): run from the repository root;
# results go to $OUT (and out/ for the NVLink grid the socket runs read
# their rates from). Usage: bash benchmarks/convergence_gpu.sh MODE:
#   nvlink  gpt2-small lr grid (dense, onebit_adamw+warm), 4 runs at a time
#   socket  dense and onebit_adamw+warm at the grid's best rates, NCCL socket
#   onegpu  one-GPU runs (one per GPU, two rates) and the +flush50 variant
#   final   the 1.5e-4 column and density 0.05 (NVLink, then socket)
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export JAX_COMPILATION_CACHE_DIR=$PWD/out/jaxcache  # the socket runs reuse the NVLink compiles
OUT=${OUT:-out}
mkdir -p out "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpus.txt"
B="python benchmarks/convergence.py lm --preset gpt2-small --steps 1000 --eval-every 50 --eval-batches 8"
case "$1" in
nvlink)
  $B --recipes dense,onebit_adamw+warm --lrs 3e-4,6e-4 --parallel 4 --timeout 560 \
     --out out/conv_gpt2_2gpu_nvlink.json --plot "$OUT/conv_gpt2_2gpu_nvlink.png" 2>&1 | tee "$OUT/nvlink.log"
  cp out/conv_gpt2_2gpu_nvlink.json "$OUT/" ;;
socket)
  export NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 NCCL_NET=Socket NCCL_SOCKET_IFNAME=lo
  LRS=$(python - <<'PY'
import json
d = json.load(open("out/conv_gpt2_2gpu_nvlink.json"))
best = {}
for r in d["runs"]:
  if r.get("failed"): continue
  k = r["recipe"].partition("+")[0]
  if k not in best or r["final_val_loss"] < best[k][1]: best[k] = (r["lr"], r["final_val_loss"])
print(f"dense={best['dense'][0]};onebit_adamw={best['onebit_adamw'][0]}")
PY
)
  echo "best lrs: $LRS"
  $B --recipes dense,onebit_adamw+warm --lrs-for "$LRS" --parallel 1 --timeout 400 \
     --out out/conv_gpt2_2gpu_socket.json --plot "$OUT/conv_gpt2_2gpu_socket.png" 2>&1 | tee "$OUT/socket.log"
  cp out/conv_gpt2_2gpu_socket.json "$OUT/" ;;
onegpu)
  CUDA_VISIBLE_DEVICES=0 $B --recipes dense,onebit_adamw+warm --lrs 3e-4 --parallel 2 --timeout 560 \
     --out "$OUT/conv_gpt2_1gpu_a.json" > "$OUT/onegpu_a.log" 2>&1 &
  CUDA_VISIBLE_DEVICES=1 $B --recipes dense,onebit_adamw+warm --lrs 6e-4 --parallel 2 --timeout 560 \
     --out "$OUT/conv_gpt2_1gpu_b.json" > "$OUT/onegpu_b.log" 2>&1 &
  $B --recipes onebit_adamw+warm+flush50 --lrs 3e-4 --parallel 1 --timeout 560 \
     --out "$OUT/conv_gpt2_2gpu_flush.json" > "$OUT/flush.log" 2>&1 &
  wait; tail -n 4 "$OUT"/*.log ;;
final)
  $B --recipes dense,onebit_adamw+warm --lrs 1.5e-4 --parallel 2 --timeout 380 \
     --out "$OUT/conv_gpt2_2gpu_nvlink_lr15.json" > "$OUT/nvlink_lr15.log" 2>&1 &
  $B --recipes onebit_adamw+warm --density 0.05 --lrs 3e-4 --timeout 380 \
     --out "$OUT/conv_gpt2_2gpu_nvlink_d05.json" > "$OUT/nvlink_d05.log" 2>&1 &
  wait
  export NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 NCCL_NET=Socket NCCL_SOCKET_IFNAME=lo
  $B --recipes onebit_adamw+warm --density 0.05 --lrs 3e-4 --timeout 190 \
     --out "$OUT/conv_gpt2_2gpu_socket_d05.json" > "$OUT/socket_d05.log" 2>&1
  grep -h "val " "$OUT"/*.log ;;
esac
