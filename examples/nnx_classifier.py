"""A flax NNX classifier with BatchNorm, trained data-parallel with jaxfuse.

Synthetic data (10 Gaussian classes in 64 dimensions), 8 simulated CPU
devices by default. It shows, in one file:

- the NNX split: parameters (differentiated, synced sparse) and the rest
  (BatchNorm statistics: averaged over the workers each step, so every
  worker keeps the same);
- the recipe: ``jaxfuse.onebit_adamw`` after a dense warm-up and a density
  ramp (``jaxfuse.density_warmup``), one compiled step per phase;
- checkpoint and resume anywhere, inside the warm-up too: the step and the
  data position ride along (``state.step``; batch t is a function of t);
- the dense baseline written correctly: the same step with an all-dense
  plan and ``jaxfuse.sync_adamw``, exactly ``lax.pmean`` of the gradients
  and then AdamW. (A plain ``optax.adamw`` is refused: the builder
  differentiates each worker's own loss, ``jaxfuse.local_params``, so
  something must average the gradients.)

  python examples/nnx_classifier.py                        # recipe + baseline
  python examples/nnx_classifier.py --ckpt ck --stop-after 60 --no-baseline
  python examples/nnx_classifier.py --ckpt ck --no-baseline   # resumes at 60
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--steps", type=int, default=300, help="steps in all")
  p.add_argument("--cpu-devices", type=int, default=8,
                 help="simulated devices on a machine without accelerators")
  p.add_argument("--density", type=float, default=0.05)
  p.add_argument("--dense-steps", type=int, default=30,
                 help="dense steps first (onebit_adamw's warm-up)")
  p.add_argument("--ramp-steps", type=int, default=15,
                 help="steps at each density of the ramp")
  p.add_argument("--rows", type=int, default=16, help="rows per worker")
  p.add_argument("--lr", type=float, default=3e-3)
  p.add_argument("--ckpt", help="checkpoint folder: resume from its latest "
                 "step, save every --save-every steps and at the end")
  p.add_argument("--save-every", type=int, default=50)
  p.add_argument("--stop-after", type=int,
                 help="save and stop after this step (an interrupted run)")
  p.add_argument("--no-baseline", action="store_true",
                 help="skip the dense baseline")
  p.add_argument("--json-out", help="write losses and accuracies here")
  return p.parse_args(argv)


ARGS = parse_args()
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS",
                                                                ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force"
                             f"_host_platform_device_count={ARGS.cpu_devices}")

# pylint: disable=wrong-import-position
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxfuse
from jaxfuse.state import checkpoint

FEATURES, CLASSES = 64, 10


class Classifier(nnx.Module):

  def __init__(self, rngs: nnx.Rngs):
    self.l1 = nnx.Linear(FEATURES, 128, rngs=rngs)
    self.norm = nnx.BatchNorm(128, rngs=rngs)
    self.l2 = nnx.Linear(128, CLASSES, rngs=rngs)

  def __call__(self, x):
    return self.l2(jax.nn.relu(self.norm(self.l1(x))))


CENTERS = np.random.default_rng(1234).normal(size=(CLASSES, FEATURES))


def batch_at(t: int, rows: int):
  """Batch t (a function of t alone: resuming at step t reads on from
  here). Labels and points around their class centre."""
  rng = np.random.default_rng([7, t])
  y = rng.integers(0, CLASSES, rows)
  x = CENTERS[y] + 1.5 * rng.normal(size=(rows, FEATURES))
  return x.astype(np.float32), y.astype(np.int32)


def make_loss(graphdef):
  """``loss_fn(params, rest, batch) -> (loss, (new_rest, correct))``."""
  def loss_fn(params, rest, batch):
    # new Variables inside the trace, which BatchNorm's forward updates
    model = nnx.merge(graphdef, params, rest, copy=True)
    x, y = batch
    logits = model(x)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    correct = jnp.sum(jnp.argmax(logits, -1) == y)   # summed over workers
    return loss, (nnx.state(model, nnx.Not(nnx.Param)), correct)
  return loss_fn


def train(phases_of, optimizer, mesh, args, ckpt: str | None):
  """Train ``args.steps`` steps; (losses, held-out accuracy, stopped)."""
  model = Classifier(nnx.Rngs(0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  plan = jaxfuse.plan(params, density=args.density)
  options = jaxfuse.StepOptions(has_aux=True, model_state=rest)
  state, step = jaxfuse.make_train_step(make_loss(graphdef), params,
                                        optimizer, phases_of(plan), mesh,
                                        options)
  mngr = checkpoint.manager(ckpt) if ckpt else None
  if mngr is not None:
    state = step.restore(mngr, state)       # the latest, if there is one
    if state.step:
      print(f"resumed at step {state.step} (phase "
            f"{step.phases.index(step.phase_at(state.step))})")
  rows = args.rows * mesh.size
  losses, stopped = [], False
  while state.step < args.steps:
    state, (loss, correct) = step(state, batch_at(state.step, rows))
    losses.append(float(loss))
    t = state.step
    if t % 25 == 0 or t == args.steps:
      stats = jaxfuse.summarize(jaxfuse.sync_stats(state.opt_state),
                                step.phase_at(t - 1).plan)
      print(f"step {t:4d}  loss {float(loss):.4f}  batch accuracy "
            f"{int(correct) / rows:.3f}  density {stats['density']:.4f}")
    if mngr is not None and (t % args.save_every == 0 or t == args.steps or
                             t == args.stop_after):
      step.save(mngr, state)
    if t == args.stop_after:
      stopped = True
      break
  if mngr is not None:
    mngr.wait_until_finished()
  nnx.update(model, state.params, state.model_state)
  model.eval()                                  # BatchNorm's running stats
  x, y = batch_at(-1 % 2**31, 2048)             # held out: no step reads it
  accuracy = float(np.mean(np.argmax(model(x), -1) == y))
  return losses, accuracy, stopped


def main(args) -> dict:
  mesh = jaxfuse.make_mesh()
  recipe = functools.partial(jaxfuse.onebit_adamw, learning_rate=args.lr)
  warmup = functools.partial(jaxfuse.density_warmup,
                             dense_steps=args.dense_steps,
                             steps=args.ramp_steps)
  losses, accuracy, stopped = train(warmup, recipe, mesh, args, args.ckpt)
  out = {"losses": losses, "accuracy": accuracy, "stopped": stopped}
  print(f"jaxfuse recipe: held-out accuracy {accuracy:.3f}")
  if not args.no_baseline and not stopped:
    # The dense baseline: every leaf dense (one pmean per bucket), AdamW.
    def dense(plan):
      return jaxfuse.with_density(plan, 1.0)
    adamw = functools.partial(jaxfuse.sync_adamw, learning_rate=args.lr)
    base_losses, base_accuracy, _ = train(dense, adamw, mesh, args, None)
    print(f"dense AdamW:    held-out accuracy {base_accuracy:.3f}")
    out.update(baseline_losses=base_losses, baseline_accuracy=base_accuracy)
  if args.json_out:
    with open(args.json_out, "w", encoding="utf-8") as f:
      json.dump(out, f)
  return out


if __name__ == "__main__":
  main(ARGS)
  sys.exit(0)
