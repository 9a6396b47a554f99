#!/usr/bin/env bash
# The GPU suites, one runner: run from the repository root as
#   bash benchmarks/gpu.sh SUITE [ARGS]
# with SUITE one of
#   convergence MODE  gpt2-small to 1000 steps on 2 GPUs, dense against the
#                     README recipe (MODE: nvlink, socket, onegpu, final)
#   overlap           how much of the sparse communication a step hides
#                     (MODE=delay|single|flags|early|plans|finish|gemm|nccl|
#                     kth|window|reference|wire in the environment)
#   scaling MODE      throughput, planner accuracy and convergence on
#                     several GPUs (MODE: conv, socket, nvlink, recal, multi,
#                     conv8, readme, one, early, procs, procsdiag, steady,
#                     simulated, cause)
#   checks MODE       correctness and precision checks (MODE: suite, resume,
#                     bf16, kernels, variants)
# Each suite's modes, environment variables and outputs are described at
# its function below (`bash benchmarks/gpu.sh SUITE --help` prints them).
# Each suite runs in a subshell of its own.

# gpt2-small to 1000 steps on 2 GPUs of one host, dense against the README
# recipe (docs/convergence.md, 2 x H200): run from the repository root;
# results go to $OUT (and out/ for the NVLink grid the socket runs read
# their rates from). Usage: bash benchmarks/gpu.sh convergence MODE:
#   nvlink  gpt2-small lr grid (dense, onebit_adamw+warm), 4 runs at a time
#   socket  dense and onebit_adamw+warm at the grid's best rates, NCCL socket
#   onegpu  one-GPU runs (one per GPU, two rates) and the +flush50 variant
#   final   the 1.5e-4 column and density 0.05 (NVLink, then socket)
suite_convergence() (
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
)

# How much of gpt2-small's sparse communication a step hides
# (docs/benchmarks.md "Overlap"): the README recipe's sparse phase, plan
# size 64 MiB, on every GPU of one host, NCCL over sockets (a commodity-
# network stand-in). Run from the repository root; results in $OUT (default
# out/). Each XLA flag set runs in its own process (XLA_FLAGS is read once
# per process). Each run prints the step time of its variants, the one-GPU
# step T1 and the collectives alone G where timed, and where the compiled
# schedule starts each collective:
#   bash benchmarks/gpu.sh overlap            # MODE=delay, ~6 minutes on 4 GPUs
# MODE=delay (default): the plain step against jaxfuse.delayed with
# jaxfuse.xla_flags, at densities 0.05 and 0.01.
# MODE=single: the delayed step with one sparse bucket.
# MODE=flags: the scheduler's options on the undelayed step (default, no
# latency hiding, the speed-of-light estimator, PGLE) and the probe.
# MODE=early: the step under jaxfuse.send_early (its defaults)
# with jaxfuse.xla_flags against the plain step, at each of DENSITIES
# (default 0.05; no variant starts after DEADLINE_S, so under about
# 10 minutes), with jax.profiler
# traces of both for `jaxfuse show PLAN --measured TRACE`; then the plain
# step with the flags, window 1, no flags, no start_early.
# MODE=plans: the step under jaxfuse.send_early with the flags, traced,
# for size 64 MiB and then each saved plan of PLANS (space-separated
# files, e.g. a cost strategy's plans), at DENSITIES (default 0.05),
# after the plain step (T1 and G; both traced, T1's kernels printed);
# SIZE=0 leaves out the size 64 MiB plan.
# MODE=finish: the send_early step with the flags, traced, with
# finish_under_last=False and with its default (the last bucket's decode
# and update wait for the other buckets', so that those run under its
# all-gather), for size 64 MiB and each saved plan of PLANS, after the plain
# step (T1 and G), at DENSITIES (default 0.05).
# MODE=gemm: the matrix products beside NCCL's kernels. For each XLA flag
# set of GEMM_FLAGS (default: none, XLA's Triton GEMMs for every product,
# cuBLASLt), the plain step with T1 and G, then the send_early step with
# the network flags, traced, at DENSITIES (default 0.05).
# MODE=nccl: the send_early step with the flags under NCCL settings that
# may slow the compute kernels beside it less (fewer channels take fewer
# SMs; the Simple protocol instead of LL; NCCL_VARIANTS, default
# "default NCCL_MAX_NCHANNELS=2 NCCL_MAX_NCHANNELS=1 NCCL_PROTO=Simple"),
# each traced, after the plain step (T1 and G), at DENSITIES (default 0.05).
# MODE=kth: the send_early step with the flags for size 64 MiB and each
# saved plan of PLANS under each k-th-largest method of KTH_METHODS
# (default "pallas radix": the one-kernel radix select against XLA's
# rounds, which spread one bucket's call over the whole card), after the
# plain step (T1 and G), at DENSITIES (default 0.05).
# MODE=window: send_early's window (how many points of the backward on
# a collective must end) for each compute dtype of DTYPES (default
# "float32 bfloat16": the model's products in that dtype, parameters and
# gradients float32): the plain step (T1 and G), then the send_early step
# with the flags for each window of WINDOWS (default "1 2"; 0: unbounded)
# and each network speed of NETS (GB/s given to jaxfuse.xla_flags, default
# NET_GBYTES_S or 3: a lower one makes XLA cover each collective with more
# compute), traced, for the size 64 MiB plan or PLAN, at DENSITIES
# (default 0.05).
# MODE=reference: the figures of docs/benchmarks.md's "Overlap" table in
# one call: float32 with the small-last-bucket plan (plain step with T1
# and G, then send_early with window 1 and xla_flags(3), and with window 2
# and xla_flags(1.5), traced), bfloat16 with size 64 MiB (the same
# three), then float32 at density 0.01 (plain, window 2 and
# xla_flags(1.5)); about 11 minutes on 2 GPUs (DEADLINE_S=470 stops
# after the bfloat16 runs).
# MODE=wire: the wire's slots (the estimator's and headroom's share of G)
# under send_early with window 2 and xla_flags(GB/s, default 1.5): each
# DTYPE:ESTIMATOR:HEADROOM[:GB/s[:SPARSE_WIRE]] of WIRE_RUNS in order
# (SPARSE_WIRE: gradient, the default, or bfloat16; default runs:
# bfloat16 dgc 1.5, topk, dgc 1.2; float32 dgc 1.5, topk; bfloat16 dgc
# 1.5 again; fewer slots may need a lower speed, docs/choosing.md),
# then the plain step (T1 and G) of each DTYPE:ESTIMATOR:HEADROOM
# [:SPARSE_WIRE] of WIRE_PLAIN (default "bfloat16:topk:1.5").
# OVERLAP_ARGS: more arguments for every `overhead.py overlap` run (e.g. "--dtype
# bfloat16"). No run starts after DEADLINE_S seconds (default 480).
# STRATEGY=aligned (or single) plans the step as that strategy instead of size 64 MiB;
# PLAN=FILE runs a saved plan (e.g. a cost strategy's, planned elsewhere).
suite_overlap() (
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 NCCL_NET=Socket NCCL_SOCKET_IFNAME=lo
OUT=${OUT:-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpus.txt"
net_flags() {  # GB/s -> jaxfuse.xla_flags(GB/s)
  python -c "import jaxfuse; print(jaxfuse.xla_flags($1))"
}
NET=$(net_flags "${NET_GBYTES_S:-3}")
LHS=--xla_gpu_enable_latency_hiding_scheduler
T0=$(date +%s)
run() {  # density, label, extra args...; XLA_FLAGS from the caller
  local d=$1 label=$2; shift 2
  if (( $(date +%s) - T0 > ${DEADLINE_S:-480} )); then
    echo "$label ($d): skipped, past DEADLINE_S"; return 0
  fi
  timeout ${RUN_TIMEOUT:-200} python benchmarks/overhead.py overlap --density "$d" \
      --label "$label" --hlo-dir "$OUT/hlo_$d" ${STRATEGY:+--strategy $STRATEGY} ${PLAN:+--plan $PLAN} \
      --out "$OUT/overlap_${d}_$label.json" ${OVERLAP_ARGS:-} "$@" 2>&1 \
      | grep -v "^WARNING\|^I0000\|^E0000\|^W0000" | tail -n 12 \
      | tee "$OUT/overlap_${d}_$label.log"
}
each_plan() {  # FN: at each of DENSITIES, the plain step (T1 and G), then
  # FN density name file for size 64 MiB (file "") and each plan of PLANS
  local d p name
  for d in ${DENSITIES:-0.05}; do
    run $d default_ --variants base
    for p in size ${PLANS:-}; do
      name=$(basename "$p" .json); name=${name%%_*}
      [ "$p" = size ] && p=
      "$1" "$d" "$name" "$p"
    done
  done
}
case "${MODE:-delay}" in
early)
  # In order of promise, so that DEADLINE_S cuts the least useful.
  E="--variants base --send-early --skip-comm --skip-one-gpu"
  for d in ${DENSITIES:-0.05}; do
    run $d default_ --variants base --trace-dir "$OUT/trace_default"
    XLA_FLAGS="$NET" run $d net_early_ $E --trace-dir "$OUT/trace_early"
    XLA_FLAGS="$NET" run $d net_plain_ --variants base --skip-comm \
        --skip-one-gpu
    XLA_FLAGS="$NET" run $d net_early_w1_ $E --window 1
    run $d early_ $E
    XLA_FLAGS="$NET" run $d net_early_nohint_ $E --no-start-early
  done ;;
plans)
  E="--variants base --send-early --skip-comm --skip-one-gpu"
  for d in ${DENSITIES:-0.05}; do
    run $d default_ --variants base --trace-dir "$OUT/trace_default"
    [ "${SIZE:-1}" = 0 ] || XLA_FLAGS="$NET" run $d net_early_size_ $E \
        --trace-dir "$OUT/trace_early_size"
    for p in ${PLANS:-}; do
      name=$(basename "$p" .json); name=${name%%_*}
      XLA_FLAGS="$NET" PLAN="$p" run $d "net_early_${name}_" $E \
          --trace-dir "$OUT/trace_early_$name"
    done
  done ;;
kth)
  E="--variants base --send-early --skip-comm --skip-one-gpu"
  kth_runs() {  # density, plan name, plan file ("": size 64 MiB)
    for m in ${KTH_METHODS:-pallas radix}; do
      XLA_FLAGS="$NET" PLAN="$3" run $1 "net_early_${2}_kth_${m}_" $E \
          --kth-method "$m"
    done
  }
  each_plan kth_runs ;;
finish)
  E="--variants base --send-early --skip-comm --skip-one-gpu"
  finish_runs() {  # density, plan name, plan file ("": size 64 MiB)
    XLA_FLAGS="$NET" PLAN="$3" run $1 "net_early_${2}_" $E \
        --no-finish-under-last --trace-dir "$OUT/trace_early_${2}_$1"
    XLA_FLAGS="$NET" PLAN="$3" run $1 "net_early_${2}_last_" $E \
        --trace-dir "$OUT/trace_early_${2}_last_$1"
  }
  each_plan finish_runs ;;
gemm)
  E="--variants base --send-early --skip-comm --skip-one-gpu"
  for d in ${DENSITIES:-0.05}; do
    for x in ${GEMM_FLAGS:-none --xla_gpu_triton_gemm_any=true --xla_gpu_enable_cublaslt=true}; do
      [ "$x" = none ] && x=
      name=$(echo "${x:-none}" | sed 's/--xla_gpu_//; s/=.*//')
      XLA_FLAGS="$x" run $d "gemm_${name}_plain_" --variants base
      XLA_FLAGS="$NET $x" run $d "gemm_${name}_early_" $E \
          --trace-dir "$OUT/trace_gemm_${name}_$d"
    done
  done ;;
window)
  E="--variants base --send-early --skip-comm --skip-one-gpu"
  for x in ${DTYPES:-float32 bfloat16}; do
    for d in ${DENSITIES:-0.05}; do
      run $d "${x}_default_" --variants base --dtype $x
      for n in ${NETS:-${NET_GBYTES_S:-3}}; do
        flags=$(net_flags "$n")
        for w in ${WINDOWS:-1 2}; do
          XLA_FLAGS="$flags" run $d "${x}_net${n}_early_w${w}_" $E \
              --dtype $x --window $w \
              --trace-dir "$OUT/trace_${x}_net${n}_early_w${w}_$d"
        done
      done
    done
  done ;;
reference)
  E="--variants base --send-early --skip-comm --skip-one-gpu"
  TAIL=benchmarks/results/plans_gpt2-small_tail_2026-11-29
  F15=$(net_flags 1.5)
  PLAN=$TAIL/tail4M_rho0.05.json run 0.05 float32_plain_ --variants base
  XLA_FLAGS="$NET" PLAN=$TAIL/tail4M_rho0.05.json run 0.05 float32_early_ $E \
      --window 1
  XLA_FLAGS="$F15" PLAN=$TAIL/tail4M_rho0.05.json run 0.05 float32_early_w2_ \
      $E --window 2 --trace-dir "$OUT/trace_float32_early_w2"
  run 0.05 bfloat16_plain_ --variants base --dtype bfloat16
  XLA_FLAGS="$NET" run 0.05 bfloat16_early_ $E --dtype bfloat16 --window 1
  XLA_FLAGS="$F15" run 0.05 bfloat16_early_w2_ $E --dtype bfloat16 \
      --window 2 --trace-dir "$OUT/trace_bfloat16_early_w2"
  PLAN=$TAIL/tail4M_rho0.01.json run 0.01 float32_plain_ --variants base
  XLA_FLAGS="$F15" PLAN=$TAIL/tail4M_rho0.01.json run 0.01 float32_early_w2_ \
      $E --window 2 ;;
wire)
  E="--variants base --send-early --skip-comm --skip-one-gpu"
  i=0
  for v in ${WIRE_RUNS:-bfloat16:dgc:1.5 bfloat16:topk:1.5 bfloat16:dgc:1.2 \
             float32:dgc:1.5 float32:topk:1.5 bfloat16:dgc:1.5}; do
    IFS=: read -r x e h n w <<< "$v"
    i=$((i + 1))
    XLA_FLAGS="$(net_flags "${n:-1.5}")" \
      run 0.05 "${i}_${x}_${e}_h${h}_net${n:-1.5}${w:+_$w}_early_w2_" $E \
        --dtype "$x" --estimator "$e" --headroom "$h" \
        --sparse-wire "${w:-gradient}"
  done
  for v in ${WIRE_PLAIN:-bfloat16:topk:1.5}; do
    IFS=: read -r x e h w <<< "$v"
    run 0.05 "${x}_${e}_h${h}${w:+_$w}_plain_" --variants base --dtype "$x" \
        --estimator "$e" --headroom "$h" --sparse-wire "${w:-gradient}"
  done ;;
nccl)
  E="--variants base --send-early --skip-comm --skip-one-gpu"
  for d in ${DENSITIES:-0.05}; do
    run $d default_ --variants base
    for v in ${NCCL_VARIANTS:-default NCCL_MAX_NCHANNELS=2 NCCL_MAX_NCHANNELS=1 NCCL_PROTO=Simple}; do
      name=$(echo "$v" | tr -c 'A-Za-z0-9\n' '_' | tr 'A-Z' 'a-z')
      ( if [ "$v" != default ]; then export "$v"; fi
        XLA_FLAGS="$NET" run $d "net_early_${name}_" $E \
            --trace-dir "$OUT/trace_early_$name" )
    done
  done ;;
delay)
  run 0.05 default_ --variants base
  XLA_FLAGS="$NET" run 0.05 net_delayed_ --variants base --delay --skip-comm --skip-one-gpu
  run 0.01 default_ --variants base --skip-comm --skip-one-gpu
  XLA_FLAGS="$NET" run 0.01 net_delayed_ --variants base --delay --skip-comm --skip-one-gpu ;;
single)
  # Delayed, everything ready at the top: one sparse bucket (strategy single).
  for d in 0.05 0.01; do
    XLA_FLAGS="$NET" run $d net_delayed_single_ --variants base --delay \
        --strategy single --skip-comm --skip-one-gpu
  done ;;
flags)
  XLA_FLAGS="$LHS=false" run 0.05 nolhs_ --variants base --skip-comm --skip-one-gpu
  XLA_FLAGS="$NET" run 0.05 net_ --variants base --skip-comm --skip-one-gpu --probe
  JAX_ENABLE_PGLE=true JAX_PGLE_PROFILING_RUNS=3 XLA_FLAGS="$LHS=true" \
    run 0.05 pgle_ --variants base --skip-comm --skip-one-gpu --steps 20 --via-jit
  run 0.05 default_ --variants base --probe ;;
esac
# Leave each profile as one file (trace_*.json.xz: xz keeps the repository's
# stored traces about 30 % smaller than gzip) and the rest in one archive
# (results.tgz).
for t in "$OUT"/trace_*; do
  [ -d "$t" ] || continue
  f=$(find "$t" -name perfetto_trace.json.gz | head -n 1)
  [ -n "$f" ] && python benchmarks/planner.py pack-trace "$f" "$t.json.xz"
  rm -rf "$t"
done
(cd "$OUT" && tar czf results.tgz --exclude results.tgz --exclude 'trace_*' \
   $(ls | grep -v '^trace_\|^results.tgz$') && \
   find . -mindepth 1 -maxdepth 1 ! -name results.tgz ! -name 'trace_*' \
     ! -name gpus.txt -exec rm -rf {} +)
)

# Throughput, planner accuracy and convergence of gpt2-small on several GPUs
# of one host (docs/benchmarks.md "Throughput: the plain sparse step against dense", "Planner
# accuracy"). Run from the repository root; results go to $OUT (default
# out/). `socket` means NCCL over TCP on loopback (a commodity-network
# stand-in), `nvlink` NCCL's defaults. Usage: bash benchmarks/gpu.sh scaling
# MODE, one of (each under about 10 minutes on 2 GPUs):
#   conv     socket: dense and onebit_adamw with a dense quarter on a
#            float32 wire and DGC's ramp (density 0.05, `aligned` plan) to
#            1000 steps at lr 3e-4,
#            one run at a time: time to dense's quality (docs/convergence.md)
#   socket   socket: profile the costs on this mesh, then plans measured
#            against the simulator: dense, size 64 MiB and auto at 0.05
#            (dense and size also on one GPU, for the measured overlap η),
#            allgather / zen / spardl at 0.01
#   nvlink   NVLink: profile the costs on this mesh, then dense, size 64 MiB
#            and auto at 0.05 and 0.01; then (socket) size 64 MiB at 0.05
#            with XLA's latency-hiding scheduler, and with it and no
#            combining (the predictions there use the NVLink costs: ignore)
#   recal    both profiles (socket and NVLink), then socket dense and size
#            64 MiB at 0.05 / 0.01 and NVLink size 64 MiB and auto at 0.05,
#            each against the simulator's prediction from those profiles
#   multi    (4 or 8 GPUs) socket profile, then dense, allgather / zen /
#            spardl and auto at 0.01 and 0.001 (ONLY=0.01 or 0.001: one
#            density; both take about 11 minutes)
#   conv8    (every GPU a worker) dense, onebit_adamw+warm and its spardl
#            variant to 1000 steps over sockets (RECIPES=… to pick; about
#            5 minutes per recipe on 4 GPUs; e.g.
#            RECIPES=onebit_adamw+warm+early+net for the step under
#            jaxfuse.send_early with jaxfuse.xla_flags(1.5), and dense+net
#            with xla_flags(3))
#   readme   (every GPU a worker) socket: dense AdamW, then the README
#            recipe (onebit_adamw, bfloat16 dense phase, then 6.25 % for
#            5 % of the steps, size 64 MiB plan, send_early, xla_flags(1.5);
#            dense with xla_flags(3))
#            at each of DENSITIES (default 0.05) and DENSE_FRACTIONS
#            (default 0.10), 1000 steps, lr 3e-4: one JSON per run (dense
#            about 4.5 minutes on 4 GPUs, each recipe run about 4);
#            SKIP_DENSE=1 reuses the dense run of an earlier call on this
#            machine; RAMP sets the warm-up densities (default 0.0625;
#            RAMP=dgc: DGC's ramp, folded by num_workers); DTYPE=bfloat16
#            computes both in bfloat16; RECIPE_ARGS: more train_lm
#            arguments for the recipe (e.g. "--send-early-window 1
#            --network-gbytes-s 3", the settings before 2026-11-30)
#   one      (one GPU) the strict quality check: dense AdamW and the README
#            recipe (bfloat16 dense phase, size 64 MiB plan) with each
#            dense phase of FRACTIONS (default "0.15 0.10") and each ramp
#            of RAMPS (default "dgc 0.0625": DGC's, or 6.25 % alone), 1000
#            steps, all side by side on GPU 0 (so their step times are not
#            comparable; about 6 minutes for five runs); DTYPE (default
#            float32) the model's compute dtype for all; each recipe run
#            also for each sparse wire of WIRES (default "gradient"; or
#            bfloat16: --sparse-wire) and each seed of SEEDS (default 0;
#            dense runs seed 0)
#   cause    (one GPU) why the recipe beats dense AdamW on one worker: each
#            arm of ARMS (default "recipe recipe_f32wire onebit_d1 dense
#            dense_b95 dense_b99 dense_frozen") at each rate of LRS (default
#            "7.5e-5 1.5e-4 3e-4 6e-4") and seed of SEEDS (default 0), 1000
#            steps, batch 8 x 1024, PARALLEL (default 4) side by side on
#            GPU 0 (their step times are not comparable); one JSON each,
#            cause_ARM_lrLR_sSEED.json, logs in cause_logs.tgz; onebit_d1 is onebit_adamw at density
#            0.999 (frozen v, next to no sparsification), dense_frozen dense
#            AdamW with v frozen at the recipe's step 100
#   early    socket: profile the costs on this mesh, then the planner's
#            plans at 0.05 (size 64 MiB, aligned, auto, single, cupcake,
#            safusion) trained under jaxfuse.send_early (its defaults;
#            RECIPE_ARGS="--send-early-window 1" for the 2026-11-28/29
#            figures' window) with
#            jaxfuse.xla_flags(3), predicted at the overlap η that the size
#            plan measures against its one-GPU step (about 10 minutes on
#            4 GPUs; STRATEGIES="aligned auto" e.g. to fit a shorter
#            limit, DENSITIES="0.05 0.01", STEPS=30; PLAIN=1 then runs
#            size 64 MiB and aligned without it; a costs_early.json
#            already in OUT is reused, and PROFILE_ONLY=1 stops after
#            writing it, to split the mode over two calls; LAST_MB=16
#            adds the size plan with its last group cut to 16 MiB)
#   procs    socket: the README recipe's sparse step (size 64 MiB plan,
#            send_early, xla_flags(3), ρ = 0.05) from one process driving
#            every GPU, then from one process per GPU under jax.distributed
#            on localhost (the same global batch): how much of the step is
#            the host launching kernels for several GPUs (STEPS, default
#            30; about 3 minutes on 4 GPUs; EXTRA="--xla-defaults" keeps
#            XLA's command buffers on)
#   procsdiag  socket: where one process per GPU under jax.distributed
#            stops, 4 steps logged each: VARIANTS (default "plain early":
#            the plain step without XLA's network flags, then the procs
#            step), each cut at DIAG_TIMEOUT s (default 150) with SIGABRT,
#            so Python's faulthandler prints every thread's stack to the
#            logs; NCCL_DEBUG=WARN (about 5 minutes on 4 GPUs); DUMP=1
#            also dumps each process's compiled programs and compares the
#            order of their collectives (collectives.py collective-order;
#            the lists in collectives_VARIANT.tgz) and, like CACHE=off,
#            runs without the persistent compilation cache (CACHE=fresh:
#            an empty one that process 0 fills; default: out/jaxcache as
#            earlier runs left it); VERBOSE=1 keeps XLA's INFO log (the
#            autotuner's shards) and prints its autotuning lines
#   simulated  (one GPU) K workers simulated on it: first the README
#            recipe's step at K of WORKERS (default "8 12 16"; 8 x 1024
#            rows a worker) against K x one worker's (simulated_workers),
#            and one worker's step at 16 rows; then the scaling runs of
#            RUNS (default "dense:1:0 readme:1:0 readme:2:0 readme:4:0
#            readme:8:0 readme:16:0 readme:8:1 dense:1:1", each
#            NAME:K:SEED), two at a time: gpt2-small, 1000 steps, lr 3e-4,
#            the same global batch of 16 x 1024 split over the K workers
#            (K = 1: the real device), the recipe planned for K (its
#            default collective: the fewest bytes on K); one JSON each,
#            sim_NAME_kK_sSEED.json, the logs in sim_logs.tgz (SKIP_STEP=1
#            skips the step timing)
#   steady   socket: the README recipe's sparse phase in the training loop
#            (5 dense steps, then ρ = 0.05, size 64 MiB, send_early,
#            xla_flags(1.5); RECIPE_ARGS to add or override, e.g.
#            "--network-gbytes-s 3 --send-early-window 1") for STEPS
#            (default 300) at each compute dtype of DTYPES (default
#            "bfloat16 float32"), with the GPUs' clocks, power and
#            throttle reasons sampled every 250 ms (smi_DTYPE.csv) and the
#            last five steps traced (trace_steady_DTYPE/): whether the
#            steps slow down as training goes on, and why (about 2.5
#            minutes a dtype on 2 GPUs)
suite_scaling() (
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
export XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-out}
mkdir -p out "$OUT"
export JAX_COMPILATION_CACHE_DIR=$PWD/out/jaxcache
SOCKET="NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 NCCL_NET=Socket NCCL_SOCKET_IFNAME=lo"
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpus.txt"
MEASURE="python benchmarks/planner.py"
throttle() {  # wait while $1 or more runs of this suite are in the background
  while [ "$(jobs -rp | wc -l)" -ge "$1" ]; do wait -n; done
}
# gpt2-small's 1000-step convergence runs: the same data, seed, rate, eval
CONV="python benchmarks/convergence.py lm --preset gpt2-small --steps 1000 --eval-every 50 --eval-batches 8 --lrs 3e-4"
case "$1" in
simulated)
  if [ "${SKIP_STEP:-0}" != 1 ]; then
    python benchmarks/overhead.py simulated-workers --preset gpt2-small \
        --phases sparse --workers ${WORKERS:-8 12 16} --batch-per-worker 8 \
        --steps 8 --out "$OUT/sim_step_b8.json" 2>&1 | tail -n 8
    python benchmarks/overhead.py simulated-workers --preset gpt2-small \
        --phases sparse dense --workers 1 --batch-per-worker 16 --steps 8 \
        --out "$OUT/sim_step_b16.json" 2>&1 | tail -n 6
  fi
  readme="onebit_adamw+warm+bf16wire --dense-fraction 0.10"
  readme_extra="--strategy size --bucket-bytes 67108864 --warmup-densities 0.0625"
  logs=$(mktemp -d)   # packed into one file: a call returns few files
  for run in ${RUNS:-dense:1:0 readme:1:0 readme:2:0 readme:4:0 readme:8:0 readme:16:0 readme:8:1 dense:1:1}; do
    IFS=: read -r name k seed <<< "$run"
    sim=$([ "$k" = 1 ] || echo " --simulated-workers $k")
    if [ "$name" = dense ]; then recipe=dense; extra="--batch-size 16$sim"
    else recipe=$readme; extra="--batch-size 16 $readme_extra$sim"; fi
    $CONV --density 0.05 --seed "$seed" --recipes $recipe --extra="$extra" \
        --out "$OUT/sim_${name}_k${k}_s${seed}.json" \
        > "$logs/sim_${name}_k${k}_s${seed}.log" 2>&1 &
    throttle 2
  done
  wait
  tail -n 2 "$logs"/sim_*.log
  tar -czf "$OUT/sim_logs.tgz" -C "$logs" . ;;
conv)
  export $SOCKET
  $CONV --recipes dense,onebit_adamw+warm \
      --density 0.05 --parallel 1 --timeout 290 \
      --out "$OUT/conv_socket.json" --plot "$OUT/conv_socket.png" 2>&1 | tee "$OUT/conv.log" ;;
socket)
  export $SOCKET
  ( time python -m jaxfuse profile --model examples/lm_model.py:gpt2_small -q \
      -o "$OUT/costs_socket.json" ) > "$OUT/profile_socket.log" 2>&1
  tail -n 12 "$OUT/profile_socket.log"
  $MEASURE --out "$OUT/measure_socket_05.json" measure --transport socket \
      --costs "$OUT/costs_socket.json" --steps 10 --sizes-mb 64 \
      --densities 0.05 --strategies auto --one-worker --run-timeout 120 \
      2>&1 | tee "$OUT/measure_socket_05.log"
  $MEASURE --out "$OUT/measure_socket_01.json" measure --transport socket \
      --costs "$OUT/costs_socket.json" --steps 10 --sizes-mb 64 \
      --densities 0.01 --collectives allgather zen spardl --strategies \
      --no-dense --run-timeout 120 2>&1 | tee "$OUT/measure_socket_01.log" ;;
nvlink)
  ( time python -m jaxfuse profile --model examples/lm_model.py:gpt2_small -q \
      -o "$OUT/costs_nvlink.json" ) > "$OUT/profile_nvlink.log" 2>&1
  tail -n 12 "$OUT/profile_nvlink.log"
  $MEASURE --out "$OUT/measure_nvlink.json" measure --transport nvlink \
      --costs "$OUT/costs_nvlink.json" --steps 10 --sizes-mb 64 \
      --densities 0.05 0.01 --strategies auto --run-timeout 120 \
      2>&1 | tee "$OUT/measure_nvlink.log"
  for flags in lhs lhs+nocombine; do
    name=${flags//+/_}   # file names without a plus sign
    $MEASURE --out "$OUT/measure_socket_$name.json" measure --transport socket \
        --costs "$OUT/costs_nvlink.json" --steps 10 --sizes-mb 64 \
        --densities 0.05 --strategies --no-dense --flags $flags --flags-via jit \
        --run-timeout 100 2>&1 | tee "$OUT/measure_socket_$name.log"
  done ;;
recal)
  # Both profiles, and plans measured against them on this machine.
  for t in socket nvlink; do
    ( time env $([ $t = socket ] && echo $SOCKET) python -m jaxfuse profile \
        --model examples/lm_model.py:gpt2_small -q -o "$OUT/costs2_$t.json" \
      ) > "$OUT/profile2_$t.log" 2>&1
    tail -n 12 "$OUT/profile2_$t.log"
  done
  $MEASURE --out "$OUT/measure2_socket.json" measure --transport socket \
      --costs "$OUT/costs2_socket.json" --steps 10 --sizes-mb 64 \
      --densities 0.05 0.01 --strategies --run-timeout 100 \
      2>&1 | grep --line-buffered -v "^==" | tee "$OUT/measure2_socket.log"
  $MEASURE --out "$OUT/measure2_nvlink.json" measure --transport nvlink \
      --costs "$OUT/costs2_nvlink.json" --steps 10 --sizes-mb 64 \
      --densities 0.05 --strategies auto --no-dense --run-timeout 100 \
      2>&1 | grep --line-buffered -v "^==" | tee "$OUT/measure2_nvlink.log" ;;
multi)
  # 4 or 8 GPUs (every GPU of this machine): the socket profile, then dense
  # and each scheme at 0.01 and 0.001, and auto. About 11 runs of about a
  # minute; ONLY=0.01|0.001 runs one density.
  export $SOCKET
  [ -f "$OUT/costs_multi.json" ] || python -m jaxfuse profile \
      --model examples/lm_model.py:gpt2_small -q -o "$OUT/costs_multi.json" \
      2>&1 | tail -n 9
  for d in ${ONLY:-0.01 0.001}; do
    $MEASURE --out "$OUT/measure_multi_$d.json" measure --transport socket \
        --costs "$OUT/costs_multi.json" --steps 10 --sizes-mb 64 \
        --densities $d --collectives allgather zen spardl --strategies auto \
        $([ "$d" = 0.001 ] && echo --no-dense) --run-timeout 150 \
        2>&1 | grep --line-buffered -v "^==" | tee "$OUT/measure_multi_$d.log"
  done ;;
conv8)
  # Every GPU a worker: dense against the README's recipe and its SparDL
  # variant (RECIPES to pick), 1000 steps, socket: time to dense's quality.
  export $SOCKET
  $CONV --recipes ${RECIPES:-dense,onebit_adamw+warm,onebit_adamw+warm+spardl} \
      --density 0.05 --parallel 1 --timeout 590 \
      --out "$OUT/conv8.json" --plot "$OUT/conv8.png" 2>&1 | tee "$OUT/conv8.log" ;;
readme)
  export $SOCKET
  RAMP=${RAMP-0.0625}; [ "$RAMP" = dgc ] && RAMP=
  DT="--dtype ${DTYPE:-float32}"
  [ "${SKIP_DENSE:-0}" = 1 ] || $CONV --density 0.05 --recipes dense+net \
      --extra="$DT" --out "$OUT/readme_dense.json" 2>&1 | tail -n 3
  for d in ${DENSITIES:-0.05}; do
    for f in ${DENSE_FRACTIONS:-0.10}; do
      $CONV --density $d --dense-fraction $f \
          --recipes onebit_adamw+warm+bf16wire+early+net \
          --extra="$DT --strategy size --bucket-bytes 67108864${RAMP:+ --warmup-densities $RAMP} ${RECIPE_ARGS:-}" \
          --out "$OUT/readme_rho${d}_dense${f}${RAMP:+_ramp$RAMP}.json" 2>&1 | tail -n 3
    done
  done ;;
cause)
  C="$CONV --devices 1 --timeout 560"
  R="onebit_adamw+warm+bf16wire --dense-fraction 0.10"
  RX="--strategy size --bucket-bytes 67108864 --warmup-densities 0.0625"
  logs=$(mktemp -d)   # packed into one file: a call returns few files
  for arm in ${ARMS:-recipe recipe_f32wire onebit_d1 dense dense_b95 dense_b99 dense_frozen}; do
    case "$arm" in
      recipe) a="--density 0.05 --recipes $R"; x="$RX" ;;
      recipe_f32wire) a="--density 0.05 --recipes onebit_adamw+warm --dense-fraction 0.10"; x="$RX" ;;
      onebit_d1) a="--density 0.999 --recipes onebit_adamw --dense-fraction 0.10"; x="--strategy size --bucket-bytes 67108864" ;;
      dense) a="--density 0.05 --recipes dense"; x="" ;;
      dense_b95) a="--density 0.05 --recipes dense"; x="--b2 0.95" ;;
      dense_b99) a="--density 0.05 --recipes dense"; x="--b2 0.99" ;;
      dense_frozen) a="--density 0.05 --recipes dense"; x="--freeze-v-at 100" ;;
      *) echo "unknown arm $arm"; exit 2 ;;
    esac
    for lr in ${LRS:-7.5e-5 1.5e-4 3e-4 6e-4}; do
      for seed in ${SEEDS:-0}; do
        name=cause_${arm}_lr${lr}_s$seed
        [ -f "$OUT/$name.json" ] && continue
        $C $a --lrs "$lr" --seed "$seed" --extra="$x" --out "$OUT/$name.json" \
            > "$logs/$name.log" 2>&1 &
        throttle "${PARALLEL:-4}"
      done
    done
  done
  wait
  tail -qn 1 "$logs"/cause_*.log
  tar -czf "$OUT/cause_logs.tgz" -C "$logs" . ;;
one)
  # one JSON per run in $OUT, the logs packed into one_logs.tgz
  C="$CONV --devices 1 --density 0.05 --timeout 560"
  DT="--dtype ${DTYPE:-float32}"
  logs=$(mktemp -d)
  $C --recipes dense --extra="$DT" --out "$OUT/one_dense.json" > "$logs/one_dense.log" 2>&1 &
  for f in ${FRACTIONS:-0.15 0.10}; do
    for r in ${RAMPS:-dgc 0.0625}; do
      for w in ${WIRES:-gradient}; do
        for seed in ${SEEDS:-0}; do
          ramp=$([ "$r" = dgc ] || echo " --warmup-densities $r")
          name=one_f${f}_ramp_$r
          [ "$w" = gradient ] || name=${name}_wire_$w
          [ "$seed" = 0 ] || name=${name}_seed$seed
          $C --recipes onebit_adamw+warm+bf16wire --dense-fraction $f \
              --seed $seed --extra="$DT --strategy size --bucket-bytes \
              67108864$ramp --sparse-wire $w" \
              --out "$OUT/$name.json" > "$logs/$name.log" 2>&1 &
        done
      done
    done
  done
  wait
  tail -n 2 "$logs"/one_*.log
  tar -czf "$OUT/one_logs.tgz" -C "$logs" . ;;
early)
  export $SOCKET
  [ -f "$OUT/costs_early.json" ] || ( time python -m jaxfuse profile \
      --model examples/lm_model.py:gpt2_small -q -o "$OUT/costs_early.json" \
      ) 2>&1 | tail -n 12
  [ "${PROFILE_ONLY:-0}" = 1 ] && exit 0
  $MEASURE --out "$OUT/measure_early.json" measure --transport socket \
      --costs "$OUT/costs_early.json" --steps ${STEPS:-10} --sizes-mb 64 \
      --densities ${DENSITIES:-0.05} --one-worker --overlap measured --no-dense \
      ${LAST_MB:+--last-mb $LAST_MB} \
      --strategies ${STRATEGIES:-aligned auto single cupcake safusion} \
      --run-timeout ${RUN_TIMEOUT:-150} \
      --train-args "--dense-warmup 1 --warmup-steps 0 --send-early --network-gbytes-s 3 ${RECIPE_ARGS:-}" \
      2>&1 | grep --line-buffered -v "^==" | tee "$OUT/measure_early.log"
  if [ "${PLAIN:-0}" = 1 ]; then
    $MEASURE --out "$OUT/measure_plain.json" measure --transport socket \
        --costs "$OUT/costs_early.json" --steps 10 --sizes-mb 64 \
        --densities 0.05 --strategies aligned --no-dense --run-timeout 100 \
        2>&1 | grep --line-buffered -v "^==" | tee "$OUT/measure_plain.log"
  fi ;;
procs)
  export $SOCKET
  A="--preset gpt2-small --steps ${STEPS:-30} --log-every 10 --density 0.05
     --optimizer onebit_adamw --dense-warmup 1 --warmup-steps 0 --send-early
     --network-gbytes-s 3 --strategy size --bucket-bytes 67108864 ${EXTRA:-}"
  n=$(nvidia-smi -L | wc -l)
  timeout 280 python examples/train_lm.py $A --json-out "$OUT/procs_1.json" \
      > "$OUT/procs_1.log" 2>&1
  port=$(python -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')
  for ((i = 0; i < n; i++)); do
    CUDA_VISIBLE_DEVICES=$i timeout 280 python examples/train_lm.py $A \
        --coordinator "localhost:$port" --num-processes $n --process-id $i \
        --json-out "$OUT/procs_$n.json" > "$OUT/procs_${n}_$i.log" 2>&1 &
  done
  wait
  python - "$OUT" $n <<'PY'
import json, pathlib, sys
out, n = pathlib.Path(sys.argv[1]), sys.argv[2]
for name, label in (("procs_1", "one process, every GPU"),
                    (f"procs_{n}", f"{n} processes, one GPU each")):
  f = out / f"{name}.json"
  r = json.loads(f.read_text()) if f.exists() else {}
  t = r.get("steady_step_time_s")
  print(f"{label:28s} " + (f"{1e3 * t:.1f} ms a sparse step" if t else
                            f"failed (see {name}*.log)"))
PY
  ;;
procsdiag)
  export $SOCKET NCCL_DEBUG=WARN
  case "${CACHE:-keep}" in
    off) unset JAX_COMPILATION_CACHE_DIR ;;
    fresh) export JAX_COMPILATION_CACHE_DIR=$(mktemp -d) ;;
    keep) ;;
    *) echo "CACHE: off, fresh or keep, not $CACHE"; exit 2 ;;
  esac
  [ "${DUMP:-0}" = 1 ] && unset JAX_COMPILATION_CACHE_DIR  # compile, dump
  echo "compilation cache: ${JAX_COMPILATION_CACHE_DIR:-off}"
  [ "${VERBOSE:-0}" = 1 ] && export TF_CPP_MIN_LOG_LEVEL=0
  n=$(nvidia-smi -L | wc -l)
  base="--preset ${PRESET:-gpt2-small} --steps 4 --log-every 1 --density 0.05
     --optimizer onebit_adamw --dense-warmup 1 --warmup-steps 0
     --strategy size --bucket-bytes 67108864"
  for v in ${VARIANTS:-plain early}; do
    case $v in
      plain) A="$base" ;;
      early) A="$base --send-early --network-gbytes-s 3" ;;
      *) echo "VARIANTS: plain or early, not $v"; exit 2 ;;
    esac
    port=$(python -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')
    dumps=$(mktemp -d)
    for ((i = 0; i < n; i++)); do
      dump=; [ "${DUMP:-0}" = 1 ] && dump="--xla_dump_to=$dumps/${v}_$i"
      CUDA_VISIBLE_DEVICES=$i XLA_FLAGS="${XLA_FLAGS:-} $dump" \
          timeout -s ABRT ${DIAG_TIMEOUT:-150} \
          python -X faulthandler examples/train_lm.py $A \
          --coordinator "localhost:$port" --num-processes $n --process-id $i \
          > "$OUT/diag_${v}_$i.log" 2>&1 &
    done
    wait
    echo "== $v: the last lines of process 0"
    grep -v "^ *$" "$OUT/diag_${v}_0.log" | grep -v "Gloo\|^[IW][0-9]\{4\} " \
        | tail -n 40
    if [ "${VERBOSE:-0}" = 1 ]; then
      grep -i "autotun\|shard" "$OUT"/diag_${v}_*.log | cut -c 1-220 | tail -n 60
      xz -f "$OUT"/diag_${v}_*.log
    fi
    if [ "${DUMP:-0}" = 1 ]; then
      python benchmarks/collectives.py collective-order --lists-out "$dumps/lists" \
          "$dumps"/${v}_*
      tar czf "$OUT/collectives_$v.tgz" -C "$dumps/lists" .
    fi
    rm -rf "$dumps"
  done
  ;;
steady)
  export $SOCKET
  n=${STEPS:-300}
  for x in ${DTYPES:-bfloat16 float32}; do
    nvidia-smi --query-gpu=timestamp,index,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu,clocks_throttle_reasons.active \
        --format=csv -lms 250 > "$OUT/smi_$x.csv" &
    smi=$!
    python examples/train_lm.py --preset gpt2-small --steps $n --lr 3e-4 \
        --density 0.05 --optimizer onebit_adamw --dense-wire bfloat16 \
        --dense-warmup 5 --warmup-steps 0 --send-early --strategy size \
        --bucket-bytes 67108864 --log-every 50 --eval-every 0 \
        --eval-batches 0 --corpus-mb 32 --dtype $x --network-gbytes-s 1.5 \
        ${RECIPE_ARGS:-} --trace-dir "$OUT/trace_steady_$x" \
        --trace-steps $((n - 5)):$n --json-out "$OUT/steady_$x.json" 2>&1 \
        | grep "ms/step\|traced\|rror" | tail -n 10
    kill $smi
    f=$(find "$OUT/trace_steady_$x" -name perfetto_trace.json.gz | head -n 1)
    [ -n "$f" ] && python benchmarks/planner.py pack-trace "$f" \
        "$OUT/trace_steady_$x.json.xz"
    rm -rf "$OUT/trace_steady_$x"
  done ;;
*)
  echo "usage: bash benchmarks/gpu.sh scaling conv|socket|nvlink|recal|multi|conv8|readme|one|early|procs|procsdiag|steady" >&2; exit 2 ;;
esac
)

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
#           kernels per source line (kernels.py kernel-sources); one GPU, about
#           5 minutes. CHUNKS="4 1 0" runs dgc with each rows-per-chunk of
#           the fused pass's streams (overhead.py --rows-per-chunk; about
#           2 minutes more each)
#   variants  kernel variants, each row against its own dense step: the
#           k-th largests as one Pallas kernel (overhead.py --radix pallas)
#           or XLA rounds (--radix radix), the scan folded into pass 2
#           (--scan-blocks 4096) or a kernel of its own (0); their tests
#           compiled, then the ROWS (default "dgc:base
#           dgc:old topk:base topk:old"; estimator:variant with variant
#           base = today's defaults, radix, scan, both = the Pallas radix
#           and/or the folded scan, batch / bucket = the fused pass per
#           batch / one per bucket, old = XLA rounds and the scan kernel);
#           one GPU, about 8 minutes; [steps] as in kernels. TESTS=0 skips
#           the tests
# usage: bash benchmarks/gpu.sh checks suite|resume|bf16|kernels|variants [steps]
# PACK=FILE.tar.gz packs everything written into one archive at the end (a
# device call hands back only a few files: OUT=/tmp/k PACK=$OUT/k.tar.gz).
suite_checks() (
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
  python benchmarks/kernels.py kernel-sources "$out/hlo_$name/dense_None.hlo.txt" \
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
)

suite_help() {  # SUITE: the comment block above its function
  awk -v f="suite_$1() (" '/^#/ { b = b substr($0, 3) "\n"; next }
    $0 == f { printf "%s", b; exit } { b = "" }' "$0"
}
suites="convergence overlap scaling checks"
case "${1:-}" in
  convergence|overlap|scaling|checks)
    suite=$1; shift
    case "${1:-}" in -h|--help) suite_help "$suite"; exit 0 ;; esac
    "suite_$suite" "$@" ;;
  -h|--help|help) sed -n '2,/^$/s/^# \{0,1\}//p' "$0" | sed '/^$/q'; exit 0 ;;
  *) echo "usage: bash benchmarks/gpu.sh SUITE [ARGS], SUITE one of: $suites" \
       "(bash benchmarks/gpu.sh SUITE --help: its modes)" >&2; exit 2 ;;
esac
