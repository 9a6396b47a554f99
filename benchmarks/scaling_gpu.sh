#!/usr/bin/env bash
# Throughput, planner accuracy and convergence of gpt2-small on several GPUs
# of one host (docs/benchmarks.md "Throughput and scaling", "Planner
# accuracy"). Run from the repository root; results go to $OUT (default
# out/). `socket` means NCCL over TCP on loopback (a commodity-network
# stand-in), `nvlink` NCCL's defaults. Usage: bash benchmarks/scaling_gpu.sh
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
#            order of their collectives (benchmarks/collective_order.py;
#            the lists in collectives_VARIANT.tgz) and, like CACHE=off,
#            runs without the persistent compilation cache (CACHE=fresh:
#            an empty one that process 0 fills; default: out/jaxcache as
#            earlier runs left it); VERBOSE=1 keeps XLA's INFO log (the
#            autotuner's shards) and prints its autotuning lines
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
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
export XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-out}
mkdir -p out "$OUT"
export JAX_COMPILATION_CACHE_DIR=$PWD/out/jaxcache
SOCKET="NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 NCCL_NET=Socket NCCL_SOCKET_IFNAME=lo"
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpus.txt"
MEASURE="python benchmarks/planner.py"
# gpt2-small's 1000-step convergence runs: the same data, seed, rate, eval
CONV="python benchmarks/convergence.py lm --preset gpt2-small --steps 1000 --eval-every 50 --eval-batches 8 --lrs 3e-4"
case "$1" in
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
      python benchmarks/collective_order.py --lists-out "$dumps/lists" \
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
    [ -n "$f" ] && python benchmarks/pack_trace.py "$f" \
        "$OUT/trace_steady_$x.json.xz"
    rm -rf "$OUT/trace_steady_$x"
  done ;;
*)
  echo "usage: $0 conv|socket|nvlink|recal|multi|conv8|readme|one|early|procs|procsdiag|steady" >&2; exit 2 ;;
esac
