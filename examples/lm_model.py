"""The example LM: model, data, and its ``jaxfuse`` command targets.

A small decoder-only transformer (Flax linen: pre-LayerNorm, causal
self-attention, GELU MLP, learned positions, tied output head) over the
bytes of the Python standard library's own ``.py`` files (offline anywhere).
``train_lm.py`` trains it; the functions ``tiny`` and ``gpt2_small`` return
``(loss_fn, params, tokens)`` (one worker's loss, the parameters and a sample
batch of one worker's size) for the command::

  jaxfuse profile --model examples/lm_model.py:gpt2_small -o costs.json
  jaxfuse plan examples/lm_model.py:gpt2_small --costs costs.json -o plan.json
  python examples/train_lm.py --preset gpt2-small --plan plan.json
"""

from __future__ import annotations

import dataclasses
import pathlib
import sysconfig

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

@dataclasses.dataclass(frozen=True)
class ModelConfig:
  layers: int
  d_model: int
  heads: int
  seq_len: int
  vocab: int = 256
  dtype: str = "float32"  # compute dtype; parameters stay float32


# Per preset: the model, and defaults for steps, global batch (or per-device
# batch x devices), peak learning rate and warmup steps.
PRESETS = {
    "tiny": dict(model=ModelConfig(layers=2, d_model=128, heads=4, seq_len=128),
                 steps=300, batch=32, lr=3e-3, warmup=20),
    "gpt2-small": dict(model=ModelConfig(layers=12, d_model=768, heads=12,
                                         seq_len=1024),
                       steps=1000, batch_per_device=8, lr=3e-4, warmup=100),
}


class Block(nn.Module):
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x, mask):
    cfg, init = self.cfg, nn.initializers.normal(0.02)
    h = nn.LayerNorm(dtype=cfg.dtype)(x)
    x = x + nn.MultiHeadDotProductAttention(
        num_heads=cfg.heads, dtype=cfg.dtype, kernel_init=init,
        deterministic=True)(h, h, mask=mask)
    h = nn.LayerNorm(dtype=cfg.dtype)(x)
    h = nn.Dense(4 * cfg.d_model, dtype=cfg.dtype, kernel_init=init)(h)
    h = nn.Dense(cfg.d_model, dtype=cfg.dtype, kernel_init=init)(nn.gelu(h))
    return x + h


class Transformer(nn.Module):
  cfg: ModelConfig

  @nn.compact
  def __call__(self, tokens):  # (batch, time) int -> (batch, time, vocab)
    cfg = self.cfg
    # The lookup reads the float32 table and rounds after it: the lookup's
    # gradient is a scatter-add of every token's row, and in bfloat16 the
    # rows of a frequent token (a space, in source code) serialize on the
    # GPU's atomics (31-36 ms a step on an H200, against 0.04 ms).
    embed = nn.Embed(cfg.vocab, cfg.d_model,
                     embedding_init=nn.initializers.normal(0.02))
    pos = self.param("pos_embed", nn.initializers.normal(0.01),
                     (cfg.seq_len, cfg.d_model))
    x = (embed(tokens).astype(cfg.dtype)
         + pos[:tokens.shape[1]].astype(cfg.dtype))
    mask = nn.make_causal_mask(tokens)
    for i in range(cfg.layers):
      x = Block(cfg, name=f"block_{i}")(x, mask)
    x = nn.LayerNorm(dtype=cfg.dtype, name="ln_f")(x)
    head = embed.embedding.astype(cfg.dtype)  # tied output head
    return (x @ head.T).astype(jnp.float32)


def build_model(preset: str = "tiny", seq_len: int | None = None,
                dtype: str = "float32") -> Transformer:
  cfg = PRESETS[preset]["model"]
  return Transformer(dataclasses.replace(cfg, seq_len=seq_len or cfg.seq_len,
                                         dtype=dtype))


def load_corpus(cap_bytes: int = 8 * 2**20,
                val_fraction: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
  """(train, val) uint8 arrays: the stdlib's .py files, sorted, capped."""
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  files = sorted(p for p in root.rglob("*.py")
                 if "site-packages" not in p.parts and p.is_file())
  chunks, total = [], 0
  for p in files:
    if total >= cap_bytes:
      break
    try:
      data = p.read_bytes()
    except OSError:
      continue
    chunks.append(data)
    total += len(data)
  data = np.frombuffer(b"".join(chunks)[:cap_bytes], np.uint8)
  if data.size < 100_000:
    raise RuntimeError(
        f"a corpus of {data.size:,} bytes: too small to train and validate "
        f"on (cap {cap_bytes:,} bytes of the standard library's source "
        f"under {root}); give at least 0.1 MB (--corpus-mb)")
  split = int(data.size * (1 - val_fraction))
  return data[:split], data[split:]


def sample_starts(rng: np.random.Generator, data: np.ndarray, batch: int,
                  seq_len: int) -> np.ndarray:
  """Where ``batch`` random windows of ``seq_len + 1`` bytes start."""
  return rng.integers(0, data.size - seq_len - 1, size=batch)


def windows(data: np.ndarray, starts: np.ndarray, seq_len: int) -> np.ndarray:
  """The windows of ``seq_len + 1`` bytes at ``starts``, as int32."""
  return data[starts[:, None] + np.arange(seq_len + 1)].astype(np.int32)


def sample_batch(rng: np.random.Generator, data: np.ndarray, batch: int,
                 seq_len: int) -> np.ndarray:
  """``batch`` random windows of ``seq_len + 1`` bytes, as int32."""
  return windows(data, sample_starts(rng, data, batch, seq_len), seq_len)


def corpus_batch(batch: int, seq_len: int, seed: int = 0) -> np.ndarray:
  """``batch`` random windows (``seed``) of the corpus's first MiB, as
  int32: real text, for benchmarks and tests (some kernels' time depends
  on the tokens, e.g. the lookup's scatter-add on a frequent byte)."""
  train, _ = load_corpus(cap_bytes=2**20)
  return sample_batch(np.random.default_rng(seed), train, batch, seq_len)


def make_loss(model: Transformer):
  def loss_fn(params, batch):
    logits = model.apply({"params": params}, batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, batch[:, 1:]).mean()
  return loss_fn


def _target(preset: str, batch: int):
  model = build_model(preset)
  tokens = corpus_batch(batch, model.cfg.seq_len)
  params = model.init(jax.random.PRNGKey(0), tokens[:, :-1])["params"]
  return make_loss(model), params, tokens


def tiny(batch: int = 4):
  """The tiny preset, ``batch`` sequences per worker (4: 32 over 8
  workers)."""
  return _target("tiny", batch)


def gpt2_small(batch: int = 8):
  """The gpt2-small preset, ``batch`` sequences of 1024 bytes per
  worker."""
  return _target("gpt2-small", batch)
