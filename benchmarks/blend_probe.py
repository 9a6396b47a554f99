"""Do a Pallas (Triton) kernel and XLA round x = β·m + (1 − β)·g alike?

1-bit Adam's sparse phase sends the stream x = β₁·m + (1 − β₁)·g. Forming
x inside the fused sparsify pass (instead of writing it out first) keeps
the Pallas kernels bit for bit equal to their XLA reference only if both
compilers round the expression the same way: each may contract a multiply
and an add into one fused multiply-add, and which product it fuses
changes the last bit. This probe evaluates x over float32 m and g drawn
from several scales, once in a Pallas kernel and once by XLA (jit), and
counts the elements whose bits differ. Off GPU the kernel runs in Pallas's
interpret mode (XLA on both sides: a check of the probe itself).

usage: python benchmarks/blend_probe.py [--n N] [--betas 0.9 0.99]
       [--out blend.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # pylint: disable=wrong-import-position
import jax.numpy as jnp  # pylint: disable=wrong-import-position
from jax.experimental import pallas as pl  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position

from jaxfuse.kernels import reference  # pylint: disable=wrong-import-position

BLOCK = 8192

# Each form gets β as a Python float (weakly typed, as the kernel and the
# recipe pass it). "reference.blend" is the expression the fused pass and
# its XLA reference evaluate.
FORMS = {
    "reference.blend": reference.blend,
    "f32(b)*m + (1-b)*g": lambda b, m, g: jnp.float32(b) * m + (1 - b) * g,
    "m + (1-b)*(g - m)": lambda b, m, g: m + (1 - b) * (g - m),
}


def _pallas(form, beta, m, g, interpret):
  def kernel(m_ref, g_ref, o_ref):
    o_ref[...] = form(beta, m_ref[...], g_ref[...])
  spec = pl.BlockSpec((BLOCK,), lambda i: (i,))
  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct(m.shape, m.dtype),
      grid=(m.shape[0] // BLOCK,), in_specs=[spec, spec], out_specs=spec,
      interpret=interpret)(m, g)


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--n", type=int, default=2**24)
  p.add_argument("--betas", type=float, nargs="+", default=[0.9, 0.99])
  p.add_argument("--out")
  args = p.parse_args(argv)
  n = -(-args.n // BLOCK) * BLOCK
  interpret = jax.default_backend() != "gpu"
  rng = np.random.default_rng(0)
  scale = np.exp(rng.uniform(-20, 5, n)).astype(np.float32)
  m = jnp.asarray(rng.standard_normal(n).astype(np.float32) * scale)
  g = jnp.asarray(rng.standard_normal(n).astype(np.float32) * scale)
  rows = []
  print(f"{'form':22s} {'beta':>6s} {'elements':>10s} {'bits differ':>12s}")
  for name, form in FORMS.items():
    for beta in args.betas:
      want = jax.jit(lambda m_, g_, f=form, b=beta: f(b, m_, g_))(m, g)
      got = jax.jit(lambda m_, g_, f=form, b=beta: _pallas(
          f, b, m_, g_, interpret))(m, g)
      differ = int(jnp.sum(jax.lax.bitcast_convert_type(got, jnp.uint32) !=
                           jax.lax.bitcast_convert_type(want, jnp.uint32)))
      rows.append({"form": name, "beta": beta, "elements": n,
                   "differ": differ})
      print(f"{name:22s} {beta:6g} {n:10d} {differ:12d}")
  result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
            "interpret": interpret, "rows": rows}
  if args.out:
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1))
  return result


if __name__ == "__main__":
  main()
