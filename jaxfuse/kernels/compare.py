"""The float32 threshold the kernels compare magnitudes against.

The kernels compare f32(|a|) ≥ t in float32; ``comparison_threshold`` turns
a τ of any float dtype into the t for which that is exactly the reference's
``jnp.abs(acc) >= tau`` (JAX's promotion rules included).
"""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp


def round_to_bfloat16(t32: jax.Array) -> jax.Array:
  """float32 → the float32 value of its bfloat16 rounding (to nearest even).

  Done on the bits: XLA on GPU may drop a float32→bfloat16→float32 round
  trip of converts (it allows excess precision), which would change τ.
  """
  bits = lax.bitcast_convert_type(t32, jnp.uint32)
  bits = (bits + jnp.uint32(0x7FFF) + ((bits >> 16) & jnp.uint32(1))) & (
      jnp.uint32(0xFFFF0000))
  return jnp.where(jnp.isnan(t32), t32,
                   lax.bitcast_convert_type(bits, jnp.float32))


def comparison_threshold(acc_dtype, tau) -> jax.Array:
  """τ as the float32 ``t`` with  |a| ≥ τ  ⟺  f32(|a|) ≥ t  for every a.

  The comparison dtype is the reference's own (``jnp.abs(acc) >= tau``
  promotes by JAX's rules: a weakly typed τ, e.g. a Python float, takes
  ``acc``'s dtype and is rounded to it; a float32 τ stays float32). τ rounded
  to that dtype, as float32, compares exactly like the reference. A
  wider-than-float32 τ is rounded *up* to the next float32, which keeps the
  comparison exact for float32 and narrower magnitudes.
  """
  cmp_dtype = jnp.dtype(jnp.result_type(acc_dtype, tau))
  t = jnp.asarray(tau)
  if t.size != 1:
    raise ValueError(f"tau must be a scalar, got shape {t.shape}")
  t = jnp.reshape(t, ())
  if cmp_dtype.itemsize > 4:
    t = t.astype(cmp_dtype)
    t32 = t.astype(jnp.float32)
    return jnp.where(t32.astype(cmp_dtype) < t,
                     jnp.nextafter(t32, jnp.float32(jnp.inf)), t32)
  t32 = t.astype(jnp.float32)
  if cmp_dtype == jnp.bfloat16:
    return round_to_bfloat16(t32)
  if cmp_dtype == jnp.float16:
    return lax.reduce_precision(t32, exponent_bits=5, mantissa_bits=10)
  return t32
