"""The example LM as ``jaxfuse`` command targets (MODULE:FUNCTION).

Each function returns ``(loss_fn, params, tokens)``: one worker's loss, the
parameters and a sample batch of one worker's size, as ``train_lm.py``
trains it::

  jaxfuse profile --model examples/lm_model.py:gpt2_small -o costs.json
  jaxfuse plan examples/lm_model.py:gpt2_small --costs costs.json -o plan.json
  python examples/train_lm.py --preset gpt2-small --plan plan.json
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import jax  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position

import train_lm  # pylint: disable=wrong-import-position


def _target(preset: str, batch: int):
  model = train_lm.build_model(preset)
  train, _ = train_lm.load_corpus(cap_bytes=2**20)
  tokens = train_lm.sample_batch(np.random.default_rng(0), train, batch,
                                 model.cfg.seq_len)
  params = model.init(jax.random.PRNGKey(0), tokens[:, :-1])["params"]
  return train_lm.make_loss(model), params, tokens


def tiny():
  """The tiny preset, 4 sequences per worker (32 over 8 workers)."""
  return _target("tiny", 4)


def gpt2_small():
  """The gpt2-small preset, 8 sequences of 1024 bytes per worker."""
  return _target("gpt2-small", 8)
