"""apex.amp's API, doing what it does without a GPU: nothing (fp32, loss scale 1)."""

from contextlib import contextmanager


def initialize(models, optimizers=None, enabled=True, opt_level="O1", num_losses=1, **kwargs):
    if opt_level not in ("O0", "O1", "O2", "O3"):
        raise RuntimeError(f"Unexpected optimization level {opt_level}")
    return (models, optimizers) if optimizers is not None else models


@contextmanager
def scale_loss(loss, optimizers, loss_id=0, model=None, delay_unscale=False, delay_overflow_check=False):
    yield loss


def master_params(optimizer):
    for group in optimizer.param_groups:
        yield from group["params"]


def state_dict(destination=None):
    return {"loss_scaler0": {"loss_scale": 1.0, "unskipped": 0}}


def load_state_dict(state_dict):
    pass
