import os, sys
os.environ["JAX_PLATFORMS"]="cpu"; os.environ["JAX_NUM_CPU_DEVICES"]="8"
sys.path.insert(0, "/work/wt_sgd")
import jax, optax, jaxfuse
from benchmarks.sgd_stability import problem, run
mesh = jaxfuse.make_mesh(8)
a, b, L = problem(2048, 1e4, 8*64*4, 0)
lim = 2*1.9/L
for rho in (0.01, 0.1):
  for frac in (1/20, 1/40):
    for nest, d in ((True, 1.0), (True, 0.9)):
      plan = jaxfuse.plan({"w": jax.ShapeDtypeStruct((2048,), "float32")}, density=rho, strategy="single", seed=0)
      opt = jaxfuse.sgd(plan, frac*lim, momentum=0.9, nesterov=nest, residual_decay=d)
      out = run(opt, a, b, mesh, dense=False, steps=400, batch=64, horizons={100,200,400}, seed=0)
      print(f"real jaxfuse.sgd nesterov={nest} d={d} rho={rho} lim/{1/frac:.0f}", {k: f"{v:.4g}" for k,v in sorted(out.items())}, flush=True)
