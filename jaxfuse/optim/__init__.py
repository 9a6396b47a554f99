"""The optimizer side of jaxfuse: the step builder (``make_train_step``).

  state, step = jaxfuse.make_train_step(loss_fn, params, opt, phases, mesh)
  for batch in batches:
    state, loss = step(state, batch)
"""

from jaxfuse.optim.train_step import StepOptions
from jaxfuse.optim.train_step import TrainState
from jaxfuse.optim.train_step import TrainStep
from jaxfuse.optim.train_step import make_train_step

__all__ = ["StepOptions", "TrainState", "TrainStep", "make_train_step"]
