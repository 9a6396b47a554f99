#!/usr/bin/env bash
# How much of gpt2-small's sparse communication a step hides
# (docs/benchmarks.md "Overlap"): the README recipe's sparse phase, plan
# size 64 MiB, on every GPU of one host, NCCL over sockets (a commodity-
# network stand-in). Run from the repository root; results in $OUT (default
# out/). Each XLA flag set runs in its own process (XLA_FLAGS is read once
# per process). Each run prints the step time of its variants, the one-GPU
# step T1 and the collectives alone G where timed, and where the compiled
# schedule starts each collective:
#   bash benchmarks/overlap_gpu.sh            # MODE=delay, ~6 minutes on 4 GPUs
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
# OVERLAP_ARGS: more arguments for every overlap.py run (e.g. "--dtype
# bfloat16"). No run starts after DEADLINE_S seconds (default 480).
# STRATEGY=aligned (or single) plans the step as that strategy instead of size 64 MiB;
# PLAN=FILE runs a saved plan (e.g. a cost strategy's, planned elsewhere).
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
  timeout ${RUN_TIMEOUT:-200} python benchmarks/overlap.py --density "$d" \
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
  [ -n "$f" ] && python benchmarks/pack_trace.py "$f" "$t.json.xz"
  rm -rf "$t"
done
(cd "$OUT" && tar czf results.tgz --exclude results.tgz --exclude 'trace_*' \
   $(ls | grep -v '^trace_\|^results.tgz$') && \
   find . -mindepth 1 -maxdepth 1 ! -name results.tgz ! -name 'trace_*' \
     ! -name gpus.txt -exec rm -rf {} +)
