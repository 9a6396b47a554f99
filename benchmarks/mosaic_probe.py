"""What Pallas's Mosaic GPU backend can do of the fused sparsify pass.

Pass 1 of ``jaxfuse.kernels.fused_pass`` streams x and r once and writes
acc = x + r, and per block of B elements the count of |acc| >= tau and
max |acc|; with ``--words`` also the candidate mask packed into 32-bit
words (w = sum_j m_j 2^j over rows of 32). This probe writes that pass
for Mosaic GPU (TMA copies to shared memory, warpgroup arrays), checks it
bit for bit against jnp, and times it against XLA's fusion of the same
outputs. Off GPU it runs in Mosaic GPU's interpret mode (JAX >= 0.12).

usage: python benchmarks/mosaic_probe.py [--sizes N ...] [--block B]
       [--words] [--out probe.json]
"""

from __future__ import annotations

import argparse
import inspect
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # pylint: disable=wrong-import-position
from jax import lax  # pylint: disable=wrong-import-position
import jax.numpy as jnp  # pylint: disable=wrong-import-position
from jax.experimental import pallas as pl  # pylint: disable=wrong-import-position
from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=wrong-import-position

from benchmarks import kernels as kernels_bench  # pylint: disable=wrong-import-position


def _kernel(body, out, grid, names, interpret):
  kw = dict(grid=grid, grid_names=names)
  params = inspect.signature(plgpu.kernel).parameters
  kw["out_type" if "out_type" in params else "out_shape"] = out
  if interpret:
    kw["interpret"] = plgpu.InterpretGPUParams()
  return plgpu.kernel(body, **kw)


LANES = 256  # TMA copies move at most 256 elements along a dimension


def pass1(x, r, tau, block: int, words: bool, interpret: bool):
  """acc, per-block count of |acc| >= tau, max |acc| (and mask words).

  x and r are viewed as (n / 256, 256); a block is block / 256 such rows.
  """
  n = x.shape[0]
  nb, rows = n // block, block // LANES
  out = [jax.ShapeDtypeStruct((n // LANES, LANES), jnp.float32),
         jax.ShapeDtypeStruct((nb,), jnp.int32),
         jax.ShapeDtypeStruct((nb,), jnp.float32)]
  if words:
    out.append(jax.ShapeDtypeStruct((n // 32, 32), jnp.int32))

  def body(x_ref, r_ref, tau_ref, acc_ref, cnt_ref, amax_ref, *w_ref):
    b = lax.axis_index("b")
    span = pl.ds(b * rows, rows)

    def scoped(xs, rs, accs, ws, bar):
      plgpu.copy_gmem_to_smem(x_ref.at[span], xs, bar)
      plgpu.copy_gmem_to_smem(r_ref.at[span], rs, bar)
      plgpu.barrier_wait(bar)
      acc = xs[...] + rs[...]
      accs[...] = acc
      mag = jnp.abs(acc)
      hit = mag >= tau_ref[0]
      cnt = jnp.sum(hit.astype(jnp.int32))
      amax = jnp.max(mag)
      if words:
        # the mask as rows of 32, weighted by 2^lane and summed along a row
        hit32 = hit.reshape(rows * 8, 32)
        shift = lax.broadcasted_iota(jnp.int32, (rows * 8, 32), 1)
        ws[...] = jnp.broadcast_to(
            jnp.sum(hit32.astype(jnp.int32) << shift, axis=1,
                    keepdims=True), (rows * 8, 32))
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(accs, acc_ref.at[span])
      if words:
        plgpu.copy_smem_to_gmem(ws, w_ref[0].at[pl.ds(b * rows * 8,
                                                      rows * 8)])
      cnt_ref[b] = cnt
      amax_ref[b] = amax
      plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(scoped, plgpu.SMEM((rows, LANES), jnp.float32),
                  plgpu.SMEM((rows, LANES), jnp.float32),
                  plgpu.SMEM((rows, LANES), jnp.float32),
                  plgpu.SMEM((rows * 8, 32), jnp.int32),
                  plgpu.Barrier(num_arrivals=2))

  got = _kernel(body, tuple(out), (nb,), ("b",), interpret)(
      x.reshape(-1, LANES), r.reshape(-1, LANES),
      jnp.reshape(tau, (1,)).astype(jnp.float32))
  got = [got[0].reshape(n), *got[1:3]] + (
      [got[3][:, 0]] if words else [])
  return tuple(got)


def pass1_xla(x, r, tau, block: int, words: bool):
  acc = x + r
  mag = jnp.abs(acc)
  hit = mag >= tau
  out = [acc, hit.reshape(-1, block).sum(1, dtype=jnp.int32),
         mag.reshape(-1, block).max(1)]
  if words:
    bits = hit.reshape(-1, 32).astype(jnp.int32)
    out.append(jnp.sum(bits << jnp.arange(32, dtype=jnp.int32), axis=1))
  return tuple(out)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--sizes", type=int, nargs="+", default=[1 << 16])
  p.add_argument("--block", type=int, default=4096,
                 help="elements per block, a multiple of 256, at most 65536")
  p.add_argument("--words", action="store_true")
  p.add_argument("--out", default=None)
  a = p.parse_args(argv)
  gpu = jax.default_backend() == "gpu"
  rows = []
  for n in a.sizes:
    kx, kr = jax.random.split(jax.random.key(n))
    x = jax.random.normal(kx, (n,), jnp.float32)
    r = 0.1 * jax.random.normal(kr, (n,), jnp.float32)
    tau = jnp.float32(2.0)
    row = dict(n=n, block=a.block, words=a.words, device=str(jax.devices()[0]))
    ref = jax.jit(pass1_xla, static_argnums=(3, 4))
    mosaic = jax.jit(pass1, static_argnums=(3, 4, 5))
    want = ref(x, r, tau, a.block, a.words)
    try:
      got = mosaic(x, r, tau, a.block, a.words, not gpu)
      row["bitwise"] = all(bool(jnp.array_equal(g, w))
                           for g, w in zip(got, want))
    except Exception as e:  # pylint: disable=broad-except
      row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    if gpu and "error" not in row:
      gb = (3 * n * 4 + (n // 8 if a.words else 0)) / 1e9
      for name, f, args in (("mosaic", mosaic, (x, r, tau, a.block, a.words,
                                                False)),
                            ("xla", ref, (x, r, tau, a.block, a.words))):
        _, s, _ = kernels_bench._time(f, args, 20)  # back-to-back mean
        row[f"{name}_ms"] = 1e3 * s
        row[f"{name}_tb_s"] = gb / s / 1e3
    rows.append(row)
    print(json.dumps(row), flush=True)
  if a.out:
    with open(a.out, "w") as fh:
      json.dump(dict(jax=jax.__version__, rows=rows), fh, indent=1)


if __name__ == "__main__":
  sys.exit(main())
