"""Does the sparse step hide its communication behind the backward pass?

One plan of the example LM (``size`` buckets of --bucket-mb, density ρ) and
the README recipe's sparse phase (``onebit_adamw``, clip 1.0), compiled under
several XLA option sets on all GPUs. For each: where every collective starts
and finishes against the backward pass in the scheduled program
(``jaxfuse.sync.hlo.schedule``), and the measured step time T_K. Also,
on the same GPUs and one of them:

  T₁   the same step on one GPU, the same per-worker batch (no wire)
  G    the step's collectives alone (its all-gathers and psums, same sizes)
  T_b  the backward pass alone: fwd+bwd − fwd on one GPU

  hidden = (T₁ + G − T_K) / min(G, T_b)   (1: all the overlap there can be)

Each step donates its params and state, as a training loop does
(--no-donate: XLA then copies them into new buffers every step). T_K and
T₁ are medians of steps each waited for; the "pipelined" figures
dispatch the steps back to back with one wait at the end, which leaves out
the host's time between steps (``hidden_pipelined`` uses those): the
median of three such blocks of --steps steps.

With --trace-dir DIR, each variant's next 3 steps are also profiled
(``jax.profiler.trace(DIR/<variant>, create_perfetto_trace=True)``, each step
in a ``StepTraceAnnotation("train", step_num=i)`` and blocked on); the JSON
gets the trace's path and its measured overlap (``jaxfuse.planning.trace``),
and ``jaxfuse show plan.json --measured DIR/<variant>`` draws it. Where
T₁ is measured, its step is profiled too (into DIR_one_gpu), and its
matrix products and other kernels printed, to set beside each variant's.

Prints a table and writes JSON (and each variant's HLO with --hlo-dir)::

  NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 NCCL_NET=Socket \\
  NCCL_SOCKET_IFNAME=lo python benchmarks/overhead.py overlap --density 0.05 \\
      --variants base lhs lhs_sol --out overlap.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import sys
import time
from typing import NamedTuple

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

# pylint: disable=wrong-import-position
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxfuse
from jaxfuse.kernels import radix_select
from jaxfuse.sync import hlo
from jaxfuse.planning import timing
from jaxfuse.planning import trace as trace_lib
from lm_model import build_model
from lm_model import corpus_batch
from lm_model import make_loss
from lm_model import PRESETS
from train_lm_args import add_wire_args
from train_lm_args import PLAN_HEADROOM

AXIS = "data"
LHS = {"xla_gpu_enable_latency_hiding_scheduler": True}
NO_COMBINE = {"xla_gpu_all_gather_combine_threshold_bytes": 0,
              "xla_gpu_all_reduce_combine_threshold_bytes": 0}


def sol(nic_gbytes_s: float) -> dict:
  """XLA's speed-of-light latency estimator told that every GPU is its own
  node on a network of ``nic_gbytes_s`` GB/s (its NVLink table otherwise)."""
  return {"xla_gpu_enable_analytical_sol_latency_estimator": True,
          "xla_gpu_analytical_latency_estimator_options":
              f"nic_speed_gbps={nic_gbytes_s:g},gpus_per_node=1,"
              "partition_size=1,rtt_us=100"}


VARIANTS = {
    "base": {},
    "lhs": LHS,
    "lhs_sol": {**LHS, **sol(3.0)},
    "lhs_sol_nocombine": {**LHS, **sol(3.0), **NO_COMBINE},
    "lhs_nocombine": {**LHS, **NO_COMBINE},
}


def _time(fn, args, steps, carry=True):
  """Median wall time of ``steps`` calls, each waited for; ``carry``: feed
  the first two outputs back as the first two inputs (a train step)."""
  out = jax.block_until_ready(fn(*args))
  times = []
  for _ in range(steps):
    if carry:
      args = (out[0], out[1]) + tuple(args[2:])
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return float(np.median(times)), out


PIPELINED_BLOCKS = 3


def _time_pipelined(fn, args, steps, blocks=PIPELINED_BLOCKS):
  """(wall time per step, (params, state) after) of train steps
  ``fn(params, state, batch)`` dispatched back to back, ``steps`` at a
  time (``timing.time_chained``) after one waited-for step: the median of
  ``blocks`` such blocks, so that one slow step moves only its block."""
  state = jax.block_until_ready(fn(*args))[:2]
  times = []
  for _ in range(blocks):
    t, state = timing.time_chained(fn, state, [args[2]], steps=steps)
    times.append(t)
  return float(np.median(times)), state


def _fresh(tree):
  """A copy of ``tree``'s arrays (same shardings), for a step that donates
  its inputs while the originals are still needed."""
  return jax.tree.map(lambda a: a.copy(), tree)


TRACE_STEPS = 3


def capture_trace(fn, args, log_dir, steps=TRACE_STEPS):
  """Profile ``steps`` train steps of ``fn`` (outputs 0 and 1 fed back as
  inputs 0 and 1) into ``log_dir``, each in a StepTraceAnnotation("train",
  step_num=i) and waited for inside it, so its kernels fall within its step
  marker. Returns the perfetto_trace.json.gz written."""
  with jax.profiler.trace(log_dir, create_perfetto_trace=True):
    for i in range(steps):
      with jax.profiler.StepTraceAnnotation("train", step_num=i):
        out = jax.block_until_ready(fn(*args))
      args = (out[0], out[1]) + tuple(args[2:])
  return trace_lib.find_trace_file(log_dir)


def is_gemm(name: str) -> bool:
  """A matrix product's kernel (cuBLAS's xmma and nvjet kernels, CUTLASS,
  XLA's Triton GEMMs)."""
  name = name.lower()
  return any(k in name for k in ("gemm", "xmma", "nvjet", "cutlass",
                                 "matmul"))


def compute_beside_link(step) -> dict:
  """One measured step's compute kernels' summed time (seconds), matrix
  products apart from the rest, each split by whether most of the kernel
  ran beside a link (NCCL) kernel (``trace.compute_kernels``)."""
  out = {f"{kind}_{where}": 0.0 for kind in ("gemm", "other")
         for where in ("beside_link", "apart")}
  for name, seconds, beside in trace_lib.compute_kernels(step):
    kind = "gemm" if is_gemm(name) else "other"
    out[f"{kind}_{'beside_link' if beside else 'apart'}"] += seconds
  return out


def measured_overlap(path) -> dict:
  """The trace's totals over its steps (seconds, hidden share) and the
  compute kernels' time beside the link (``compute_beside_link``, summed
  over the steps), or the reason it has none (e.g. a CPU run: no GPU
  kernels)."""
  try:
    measured = trace_lib.read_trace(path)
  except trace_lib.TraceError as e:
    return {"error": str(e)}
  beside: dict = {}
  for step in measured.steps:
    for k, v in compute_beside_link(step).items():
      beside[k] = beside.get(k, 0.0) + v
  return {"device": measured.device, "steps": len(measured.steps),
          "hidden": measured.hidden,
          **{f: measured.total(f) for f in ("span", "compute_busy",
                                            "link_busy", "overlapped",
                                            "compute_waited")},
          **beside}


def kernels_line(m) -> str:
  """``measured_overlap``'s result as one line: the share of link time
  hidden, the compute stream's wait for link kernels to end
  (``trace.link_kernels``), a step's matrix products beside the link and
  apart, the other kernels (or why the trace has none)."""
  if "error" in m:
    return m["error"]
  per_step = lambda *fields: 1e3 * sum(m[f] for f in fields) / m["steps"]
  return (f"measured {100 * m['hidden']:.0f}% of the link time hidden, "
          f"compute waiting {per_step('compute_waited'):.1f} ms a step for "
          f"link kernels to end; a "
          f"step's matrix products {per_step('gemm_beside_link'):.1f} ms "
          f"beside NCCL kernels, {per_step('gemm_apart'):.1f} ms apart; "
          f"other kernels {per_step('other_beside_link', 'other_apart'):.1f}"
          " ms")


def build(args, devices):
  mesh = jax.sharding.Mesh(np.array(devices), (AXIS,))
  k = len(devices)
  model = build_model(args.preset, None, args.dtype)
  seq = model.cfg.seq_len
  per_worker = PRESETS[args.preset].get("batch_per_device", 4)
  params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, seq), jnp.int32))
  params = jax.device_put(params["params"], NamedSharding(mesh, P()))
  loss_fn = make_loss(model)
  # The corpus's bytes, as training sees them (kernels' time can depend on
  # the tokens).
  tokens = corpus_batch(per_worker * k, seq)
  batch = jax.device_put(tokens, NamedSharding(mesh, P(AXIS)))
  if args.plan:      # e.g. a cost strategy's plan, made where its costs are
    return mesh, params, loss_fn, batch, jaxfuse.Plan.load(args.plan)
  sizing = ({"bucket_bytes": int(args.bucket_mb * 2**20)}
            if args.strategy == "size" else {})
  plan = jaxfuse.plan(params, density=args.density, strategy=args.strategy,
                      estimator=args.estimator, **sizing,
                      settings=jaxfuse.Settings(
                          headroom=args.headroom, seed=0,
                          sparse_wire=args.sparse_wire),
                      collective=jaxfuse.collectives.AllGather(
                          packed_indices=args.packed_indices),
                      order=jaxfuse.planning.ordering.FromLoss(
                          loss_fn, (tokens[:1],)))
  return mesh, params, loss_fn, batch, plan


class StepForm(NamedTuple):
  """How ``sparse_step`` wraps the step. ``delay``: under
  ``jaxfuse.delayed``; ``early``: under ``jaxfuse.send_early`` with
  ``window``, ``start_early`` and ``finish_under_last``; ``donate``: params
  and state donated, as a training loop does, so XLA updates them in place
  instead of copying them into new buffers every step."""
  delay: bool = False
  early: bool = False
  window: int | None = 1
  start_early: bool = True
  donate: bool = True
  finish_under_last: bool = True


def sparse_step(mesh, plan, loss_fn, params, options,
                form: StepForm = StepForm()):
  """The README recipe's sparse phase, jitted with ``options``, in the
  ``form`` (a ``StepForm``)."""
  delay, early, window, start_early, donate, finish_under_last = form
  opt = jaxfuse.onebit_adamw(plan, 1e-4, weight_decay=0.01,
                             options=jaxfuse.RecipeOptions(clip_norm=1.0))
  if delay:
    opt = jaxfuse.delayed(opt)
  state = jaxfuse.init_state(opt, params, mesh)
  specs = jaxfuse.state_specs(state)

  def local(params, state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(jaxfuse.local_params(params),
                                              batch)
    updates, state = opt.update(grads, state, params)
    return (optax.apply_updates(params, updates), state,
            jax.lax.pmean(loss, AXIS))
  if early:
    local = jaxfuse.send_early(local, window=window,
                               start_early=start_early,
                               finish_under_last=finish_under_last)
  step = jax.jit(jax.shard_map(local,
                               mesh=mesh, in_specs=(P(), specs, P(AXIS)),
                               out_specs=(P(), specs, P())),
                 donate_argnums=(0, 1) if donate else (),
                 compiler_options={**jaxfuse.xla_options(), **options})
  return step, state


_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")


def wire_shapes(text: str) -> list[tuple[str, str, tuple[int, ...]]]:
  """(opcode, dtype, per-worker operand shape) of each collective."""
  out = []
  for inst, _ in hlo.collective_inputs(text):
    m = _SHAPE.search(inst.shape)
    if not m:
      continue
    dims = tuple(int(d) for d in m.group(2).split(",") if d)
    out.append((inst.opcode.replace("-start", ""), m.group(1), dims))
  return out


def comm_only(mesh, shapes, steps):
  """G: the step's collectives alone, one after another (one stream)."""
  k = mesh.devices.size
  bufs = []
  for op, dtype, dims in shapes:
    if op == "all-gather":   # the gathered shape: (K, m) from (1, m) each
      dims = (1,) + tuple(dims[1:])
    bufs.append((op, jnp.zeros((k,) + dims, jnp.dtype(
        {"u32": "uint32", "f32": "float32", "bf16": "bfloat16",
         "s32": "int32"}.get(dtype, "float32")))))

  def local(*xs):
    outs = []
    for (op, _), x in zip(bufs, xs):
      x = x[0]
      outs.append(jax.lax.all_gather(x, AXIS, tiled=True) if op ==
                  "all-gather" else jax.lax.psum(x, AXIS))
    return tuple(jnp.sum(o[:1]).astype(jnp.float32)[None] for o in outs)
  fn = jax.jit(jax.shard_map(local, mesh=mesh,
                             in_specs=tuple(P(AXIS) for _ in bufs),
                             out_specs=tuple(P(AXIS) for _ in bufs)))
  xs = [jax.device_put(b, NamedSharding(mesh, P(AXIS))) for _, b in bufs]
  t, _ = _time(fn, xs, steps, carry=False)
  return t


def probe(mesh, model, shapes, source, steps):
  """The scheduler alone, without the sparse work: each worker's backward
  and all-gathers of the step's wire sizes, whose results the step's output
  needs. ``model`` is (loss_fn, params, batch). ``source`` "state": the
  buffers are inputs (a one-step-delayed sync); "grads": each is cut from
  its own run of consecutive gradient leaves, in reverse pytree order
  (about backward-ready order), so it is ready once those leaves are."""
  loss_fn, params, batch = model
  k = mesh.devices.size
  sizes = [int(np.prod(d[1:])) for op, _, d in shapes if op == "all-gather"]
  bufs = [jax.device_put(jnp.zeros((k, m), jnp.float32),
                         NamedSharding(mesh, P(AXIS))) for m in sizes]

  def cut(leaves, m):
    """m elements from the fewest leading leaves; the leaves left over."""
    taken, got = [], 0
    while got < m and leaves:
      taken.append(leaves[0].reshape(-1))
      got += taken[-1].size
      leaves = leaves[1:]
    x = jnp.concatenate(taken) if taken else jnp.zeros((0,), jnp.float32)
    return jnp.resize(x, (m,)) if x.size else jnp.zeros((m,)), leaves

  def local(params, bufs, batch):
    grads = jax.grad(loss_fn)(jaxfuse.local_params(params), batch)
    leaves = list(reversed(jax.tree.leaves(grads)))
    total = sum(jnp.sum(g) for g in leaves)
    for b, m in zip(bufs, sizes):
      if source == "state":
        x = b[0]
      else:
        x, leaves = cut(leaves, m)
      total = total + 1e-30 * jnp.sum(jax.lax.all_gather(x, AXIS)[:, :8])
    return total[None]
  fn = jax.jit(jax.shard_map(local, mesh=mesh,
                             in_specs=(P(), P(AXIS), P(AXIS)),
                             out_specs=P(AXIS)),
               compiler_options=jaxfuse.xla_options())
  text = fn.lower(params, bufs, batch).compile().as_text()
  t, _ = _time(fn, (params, bufs, batch), steps, carry=False)
  return t, hlo.schedule(text, ("all-gather",))


def backward_time(loss_fn, params, batch, steps):
  """T_b on one device: value_and_grad − the forward alone."""
  fwd = jax.jit(loss_fn)
  both = jax.jit(jax.value_and_grad(loss_fn))
  t_f, _ = _time(fwd, (params, batch), steps, carry=False)
  t_fb, _ = _time(both, (params, batch), steps, carry=False)
  return t_f, t_fb - t_f


def parse_args(argv=None) -> argparse.Namespace:
  """The command line's arguments (``[]``: every default)."""
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--preset", default="gpt2-small", choices=sorted(PRESETS))
  p.add_argument("--dtype", default="float32",
                 choices=("float32", "bfloat16"),
                 help="the model's compute dtype (parameters and gradients "
                 "stay float32)")
  p.add_argument("--density", type=float, default=0.05)
  p.add_argument("--strategy", default="size",
                 choices=("size", "single", "aligned"),
                 help="the plan's strategy (size: the README recipe's and "
                 "examples/train_lm.py's default; aligned: 4 buckets)")
  p.add_argument("--plan", help="a saved plan (plan.save) to run instead "
                 "of --strategy (its density is the plan's; give the same "
                 "--density for the file names)")
  p.add_argument("--bucket-mb", type=float, default=64,
                 help="bucket size of --strategy size")
  p.add_argument("--estimator", default="dgc",
                 choices=jaxfuse.plans.ESTIMATORS,
                 help="the plan's threshold estimator (topk: exactly "
                 "⌈ρ·n⌉ slots a leaf, no headroom)")
  p.add_argument("--headroom", type=float, default=PLAN_HEADROOM,
                 help="slots per leaf ⌈ρ·n·headroom⌉ for the sampled "
                 "estimators (the wire's bytes scale with it)")
  add_wire_args(p)
  p.add_argument("--steps", type=int, default=15)
  p.add_argument("--variants", nargs="+", default=["base", "lhs", "lhs_sol"],
                 choices=sorted(VARIANTS))
  p.add_argument("--skip-one-gpu", action="store_true")
  p.add_argument("--skip-comm", action="store_true")
  p.add_argument("--via-jit", action="store_true")
  p.add_argument("--delay", action="store_true",
                 help="the recipe under jaxfuse.delayed")
  p.add_argument("--send-early", action="store_true",
                 help="the step under jaxfuse.send_early")
  p.add_argument("--window", type=int, default=2,
                 help="with --send-early: each collective ends within the "
                 "backward of this many points after it (send_early's "
                 "window, default 2 as there; 0: unbounded)")
  p.add_argument("--no-start-early", dest="start_early",
                 action="store_false",
                 help="with --send-early: without XLA's force_delay_async "
                 "hint on each collective")
  p.add_argument("--no-finish-under-last", dest="finish_under_last",
                 action="store_false",
                 help="with --send-early: finish_under_last=False (the "
                 "earlier buckets' decode and update may run after the "
                 "last collective instead of under it)")
  p.add_argument("--no-donate", dest="donate", action="store_false",
                 help="do not donate params and state to the step (XLA then "
                 "copies them into new buffers every step; a training loop "
                 "donates them)")
  p.add_argument("--probe", action="store_true",
                 help="also time the scheduler probe (see probe())")
  p.add_argument("--label", default="",
                 help="prefix of the variants' names (e.g. the XLA_FLAGS "
                      "this process runs under)")
  p.add_argument("--budget-s", type=float, default=520,
                 help="start no variant after this many seconds")
  p.add_argument("--hlo-dir")
  p.add_argument("--trace-dir",
                 help=f"profile {TRACE_STEPS} steps of each variant into "
                      "TRACE_DIR/<variant> (jax.profiler, perfetto JSON)")
  p.add_argument("--kth-method", choices=radix_select.GPU_METHODS,
                 help="how a bucket's k-th largests are found on GPUs "
                      "(radix_select.DEFAULT_GPU_METHOD, default "
                      f"{radix_select.DEFAULT_GPU_METHOD!r}): under "
                      "send_early each bucket's call runs alone")
  p.add_argument("--out")
  return p.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  if args.kth_method:
    radix_select.DEFAULT_GPU_METHOD = args.kth_method
  t_start = time.perf_counter()
  devices = jax.devices()
  mesh, params, loss_fn, batch, plan = build(args, devices)
  result = {"device": devices[0].device_kind, "num_devices": len(devices),
            "jax": jax.__version__, "preset": args.preset, "dtype": args.dtype,
            "density": args.density, "strategy": args.strategy,
            "plan_file": args.plan,
            "bucket_mb": args.bucket_mb,
            "estimator": next((l.estimator for l in plan.leaves
                               if l.estimator), None),
            "headroom": plan.settings.headroom,
            "buckets": len(plan.buckets), "variants": {},
            "date": time.strftime("%Y-%m-%d"), "delay": args.delay,
            "send_early": args.send_early, "window": args.window,
            "start_early": args.start_early,
            "finish_under_last": args.finish_under_last,
            "donate": args.donate,
            "kth_method": radix_select.DEFAULT_GPU_METHOD,
            "command": " ".join(sys.argv),
            "xla_flags": os.environ.get("XLA_FLAGS", "")}
  save = lambda: args.out and pathlib.Path(args.out).write_text(
      json.dumps(result, indent=1))
  if args.out:   # the plan that ran, for benchmarks/planner.py predict-overlap
    out = pathlib.Path(args.out)
    plan.save(out.with_name(out.stem + ".plan.json"))
  print(f"{len(devices)} x {devices[0].device_kind}, {len(plan.buckets)} "
        f"buckets, density {args.density}", flush=True)
  shapes = None
  for name in args.variants:
    if time.perf_counter() - t_start > args.budget_s:
      print(f"{name}: skipped (budget)")
      continue
    step, state = sparse_step(mesh, plan, loss_fn, params, VARIANTS[name],
                              StepForm(args.delay, args.send_early,
                                       args.window or None, args.start_early,
                                       args.donate, args.finish_under_last))
    t0 = time.perf_counter()
    compiled = step.lower(params, state, batch).compile()
    compile_s = time.perf_counter() - t0
    text = compiled.as_text()
    if args.hlo_dir:
      pathlib.Path(args.hlo_dir).mkdir(parents=True, exist_ok=True)
      pathlib.Path(args.hlo_dir, f"{args.label}{name}.hlo.txt").write_text(
          text)
    shapes = shapes or wire_shapes(text)
    sched = hlo.schedule(text)
    # --via-jit: call the jitted step (where JAX_ENABLE_PGLE profiles its
    # first runs and recompiles); its schedule is then not the one above.
    fn = step if args.via_jit else compiled
    t_k, out = _time(fn, (_fresh(params), state, batch), args.steps)
    t_pipe, out = _time_pipelined(fn, (out[0], out[1], batch), args.steps)
    variant = result["variants"][args.label + name] = {
        "options": VARIANTS[name], "step_s": t_k,
        "step_pipelined_s": t_pipe, "compile_s": compile_s,
        "backward": sched.backward, "starts": sched.starts,
        "dones": sched.dones, "kinds": sched.opcodes,
        "started_in_backward": sched.started_in_backward(),
        "instructions": sched.num_instructions}
    print(f"{args.label + name:24s} {1e3 * t_k:7.1f} ms "
          f"(pipelined {1e3 * t_pipe:.1f}; compiled in {compile_s:.0f} s, "
          f"{len(plan.buckets)} buckets)   collectives started in the "
          f"backward {sched.started_in_backward()}/{len(sched.starts)}   "
          f"backward at {sched.backward}, starts {list(sched.starts)}",
          flush=True)
    if args.trace_dir:
      path = capture_trace(fn, (out[0], out[1], batch),
                           pathlib.Path(args.trace_dir, args.label + name))
      variant["trace"] = str(path)
      variant["measured"] = measured_overlap(path)
      print(f"{'':24s} {path}: {kernels_line(variant['measured'])}",
            flush=True)
    del out
    save()
  if shapes and args.probe:
    for source in ("state", "grads"):
      t, sched = probe(mesh, (loss_fn, params, batch), shapes, source,
                       args.steps)
      result[f"probe_{source}"] = {
          "step_s": t, "backward": sched.backward, "starts": sched.starts,
          "dones": sched.dones,
          "started_in_backward": sched.started_in_backward()}
      print(f"probe {source:6s} {1e3 * t:7.1f} ms  all-gathers started in "
            f"the backward {sched.started_in_backward()}/{len(sched.starts)}"
            f"  backward {sched.backward} starts {list(sched.starts)} dones "
            f"{list(sched.dones)}", flush=True)
    save()
  if shapes and not args.skip_comm:
    result["comm_s"] = comm_only(mesh, shapes, args.steps)
    print(f"G (collectives alone) {1e3 * result['comm_s']:.1f} ms", flush=True)
  if not args.skip_one_gpu:
    one = [devices[0]]
    mesh1, params1, loss1, batch1, plan1 = build(args, one)
    step, state = sparse_step(mesh1, plan1, loss1, params1, {},
                              StepForm(donate=args.donate))
    result["one_gpu_step_s"], out1 = _time(
        step, (_fresh(params1), state, batch1), args.steps)
    result["one_gpu_step_pipelined_s"], out1 = _time_pipelined(
        step, (out1[0], out1[1], batch1), args.steps)
    if args.trace_dir:   # T1's kernels, to set beside each variant's
      path = capture_trace(step, (out1[0], out1[1], batch1),
                           pathlib.Path(args.trace_dir + "_one_gpu"))
      result["one_gpu_measured"] = measured_overlap(path)
      print(f"T1 trace {path}: {kernels_line(result['one_gpu_measured'])}",
            flush=True)
    del out1
    local = jax.device_put(params1, one[0])
    tokens = jax.device_put(np.asarray(batch1), one[0])
    result["forward_s"], result["backward_s"] = backward_time(
        loss1, local, tokens, args.steps)
    print(f"T1 {1e3 * result['one_gpu_step_s']:.1f} ms (pipelined "
          f"{1e3 * result['one_gpu_step_pipelined_s']:.1f})  forward "
          f"{1e3 * result['forward_s']:.1f}  backward "
          f"{1e3 * result['backward_s']:.1f} ms", flush=True)
  if "comm_s" in result and "one_gpu_step_s" in result:
    g, t1, tb = result["comm_s"], result["one_gpu_step_s"], result["backward_s"]
    t1p = result["one_gpu_step_pipelined_s"]
    for name, v in result["variants"].items():
      v["hidden"] = (t1 + g - v["step_s"]) / max(min(g, tb), 1e-9)
      # The same with the host running ahead (host time between waited-for
      # steps left out of both T₁ and T_K).
      v["hidden_pipelined"] = ((t1p + g - v["step_pipelined_s"]) /
                               max(min(g, tb), 1e-9))
      print(f"{name:20s} hidden {v['hidden']:.2f} (pipelined "
            f"{v['hidden_pipelined']:.2f})")
  save()
  return result

