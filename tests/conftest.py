"""Eight simulated CPU devices, configured before JAX starts."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8")

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import pytest  # pylint: disable=g-import-not-at-top,wrong-import-position

import jaxfuse  # pylint: disable=g-import-not-at-top,wrong-import-position

NUM_WORKERS = 8


@pytest.fixture(scope="session")
def mesh():
  assert len(jax.devices()) >= NUM_WORKERS, jax.devices()
  return jaxfuse.make_mesh(NUM_WORKERS)
