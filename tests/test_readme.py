"""The README's Quickstart, run as written (8 CPU workers, a small MLP in
place of the user's model): every phase of the recipe compiles and trains
under ``send_early``, and the loss falls."""

import os
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax

README = pathlib.Path(__file__).parents[1] / "README.md"


def _quickstart() -> str:
  section = README.read_text().split("## Quickstart", 1)[1]
  return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _run_quickstart(monkeypatch, total):
  """The Quickstart on ``total`` batches (no more exist: a loop that ran
  past ``total`` would stop the test); (user's names, the loss function,
  a held-out batch, the initial params)."""
  # It sets XLA_FLAGS for GPUs (read once, when JAX starts: a no-op here);
  # put the variable back afterwards for the tests that start processes.
  monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
  rng = np.random.default_rng(0)
  true_w = rng.normal(size=(64, 16)).astype(np.float32) / 8

  def draw():
    x = rng.normal(size=(32, 64)).astype(np.float32)
    return x, np.tanh(x @ true_w)

  def init_params():    # leaves of 4096 and 1024 elements: sparse
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    return {"w1": jax.random.normal(k1, (64, 64)) / 8, "b1": jnp.zeros(64),
            "w2": jax.random.normal(k2, (64, 16)) / 8, "b2": jnp.zeros(16)}

  def loss_fn(p, batch):
    x, y = batch
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] + p["b2"] - y) ** 2)

  held_out = draw()
  example = draw()
  data = [draw() for _ in range(total)]

  def batches():
    # As the README says for CPU devices: each step waits for the one
    # before (its ``loss``; XLA's CPU collectives can abort when steps
    # queue up), here where the loop draws the next batch.
    for i, batch in enumerate(data):
      if i:    # not silently None: the loop must still name its result
        assert "loss" in user, "the Quickstart's loop no longer binds loss"
        jax.block_until_ready(user["loss"])
      yield batch

  user = dict(init_params=init_params, loss_fn=loss_fn, batch=example,
              total=total, schedule=optax.constant_schedule(3e-3),
              batches=batches())
  exec(compile(_quickstart(), "README.md (Quickstart)", "exec"), user)  # pylint: disable=exec-used
  user["consumed"] = sum(1 for _ in user["batches"]) == 0
  return user, loss_fn, held_out, init_params()


def test_quickstart_runs_as_written(monkeypatch, capsys):
  user, loss_fn, held_out, first = _run_quickstart(monkeypatch, 60)
  start = float(loss_fn(first, held_out))
  phases, params = user["phases"], user["params"]
  assert user["consumed"]
  assert len(phases) >= 2 and phases[-1].stop is None
  assert all(l.density == 1.0 for l in phases[0].plan.leaves)   # dense
  # One line per phase (its last loss and the sync statistics).
  assert len(capsys.readouterr().out.strip().splitlines()) >= len(phases)
  end = float(loss_fn(jax.device_get(params), held_out))
  assert end < 0.5 * start, (start, end)


def test_quickstart_on_a_short_run_trains_exactly_its_steps(monkeypatch):
  """``total`` = 6: the warm-up arithmetic keeps one dense step (onebit's
  sparse phase moves nothing before one) and a ramp step, and the loop
  stops at ``total`` whatever the phases' bounds."""
  user, _, _, first = _run_quickstart(monkeypatch, 6)
  phases = user["phases"]
  assert phases[0].start == 0 and phases[0].stop >= 1
  assert all(l.density == 1.0 for l in phases[0].plan.leaves)   # dense
  assert user["consumed"]
  moved = [not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
           zip(jax.tree.leaves(user["params"]), jax.tree.leaves(first))]
  assert all(moved)
