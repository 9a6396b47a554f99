"""The README's Quickstart, run as written (8 CPU workers, a small MLP in
place of the user's model): every phase of its warm-up trains, the loss
falls, and params, optimizer state and losses are bitwise those of the
hand-written low-level loop (init_state, state_specs, local_params,
jax.shard_map, opt.update, one compiled step per phase)."""

import functools
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxfuse

README = pathlib.Path(__file__).parents[1] / "README.md"
ROWS = 32   # the global batch: 4 rows per worker on 8
STEPS = 204  # the README's phases: dense 0-100, 25 % to 150, 6.25 % to 200, then the plan


def _blocks() -> list[str]:
  section = README.read_text().split("## Quickstart", 1)[1].split("\n## ", 1)[0]
  return re.findall(r"```python\n(.*?)```", section, re.S)


def _problem():
  rng = np.random.default_rng(0)
  true_w = rng.normal(size=(64, 16)).astype(np.float32) / 8

  def draw():
    x = rng.normal(size=(ROWS, 64)).astype(np.float32)
    return x, np.tanh(x @ true_w)

  k1, k2 = jax.random.split(jax.random.PRNGKey(0))
  params = {"w1": jax.random.normal(k1, (64, 64)) / 8, "b1": jnp.zeros(64),
            "w2": jax.random.normal(k2, (64, 16)) / 8, "b2": jnp.zeros(16)}

  def loss_fn(p, batch):
    x, y = batch
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] + p["b2"] - y) ** 2)

  held_out = draw()
  return params, loss_fn, [draw() for _ in range(STEPS)], held_out


@pytest.fixture(scope="module")
def quickstart():
  """The first block run as written: (the user's names, the loss after
  each step, the problem)."""
  params, loss_fn, data, held_out = _problem()
  losses = []
  user = dict(params=params, loss_fn=loss_fn)

  def batches():
    for i, batch in enumerate(data):
      if i:   # the loop must still bind `loss`
        losses.append(user["loss"])
      yield batch

  user["batches"] = batches()
  exec(compile(_blocks()[0], "README.md (Quickstart)", "exec"), user)  # pylint: disable=exec-used
  losses.append(user["loss"])
  return user, losses, (params, loss_fn, data, held_out)


def _hand_loop(plan, phases, params, loss_fn, data, mesh):
  """The same training written with the low-level parts."""
  make_opt = functools.partial(jaxfuse.onebit_adamw, learning_rate=3e-4)
  params = jax.device_put(jax.tree.map(jnp.copy, params),
                          NamedSharding(mesh, P()))
  opt_state = jaxfuse.init_state(make_opt(plan), params, mesh)
  specs = jaxfuse.state_specs(opt_state)
  losses = []
  for phase in phases:
    opt = make_opt(phase.plan)

    def local(params, opt_state, batch, opt=opt):
      loss, grads = jax.value_and_grad(loss_fn)(
          jaxfuse.local_params(params), batch)
      updates, opt_state = opt.update(grads, opt_state, params)
      return (optax.apply_updates(params, updates), opt_state,
              jax.lax.pmean(loss, "data"))

    step = jax.jit(jax.shard_map(local, mesh=mesh,
                                 in_specs=(P(), specs, P("data")),
                                 out_specs=(P(), specs, P())),
                   donate_argnums=(0, 1))
    for t in range(phase.start, min(phase.stop or STEPS, STEPS)):
      batch = jax.device_put(data[t], NamedSharding(mesh, P("data")))
      params, opt_state, loss = step(params, opt_state, batch)
      jax.block_until_ready(loss)
      losses.append(loss)
  return params, opt_state, losses


def _bits(tree):
  return [np.asarray(x).tobytes() for x in jax.tree.leaves(
      jax.device_get(tree))]


def test_quickstart_is_short_and_uses_few_names():
  code = "".join(_blocks())
  lines = [l for l in code.splitlines() if l.strip()]
  names = set(re.findall(r"jaxfuse\.(\w+)", code))
  assert len(lines) <= 15, lines
  assert len(names) <= 6, sorted(names)
  assert "make_train_step" in names


def test_quickstart_trains_every_phase_and_the_loss_falls(quickstart):
  user, losses, (first, loss_fn, _, held_out) = quickstart
  state, phases = user["state"], user["phases"]
  assert len(phases) == 4 and phases[-1].start < STEPS   # all of them ran
  assert all(l.density == 1.0 for l in phases[0].plan.leaves)   # dense
  assert any(l.mode == "sparse" for l in phases[-1].plan.leaves)
  assert state.step == STEPS and len(losses) == STEPS
  start = float(loss_fn(first, held_out))
  end = float(loss_fn(jax.device_get(state.params), held_out))
  assert end < 0.7 * start, (start, end)


def test_quickstart_is_bitwise_the_hand_written_loop(quickstart):
  user, losses, (params, loss_fn, data, _) = quickstart
  hand_params, hand_opt, hand_losses = _hand_loop(
      user["plan"], user["phases"], params, loss_fn, data, user["mesh"])
  state = user["state"]
  assert _bits(state.params) == _bits(hand_params)
  assert _bits(state.opt_state) == _bits(hand_opt)
  assert _bits(losses) == _bits(hand_losses)
  # the user's own params were copied, not donated away
  assert _bits(user["params"]) == _bits(params)
