"""The learner: train state, the compiled update, and the batch it trains on.

The public names (each imported from its module on first use; rl_tpu/lazy_api.py):

    TrainState, OptimConfig,     the sharded params and optimizer state, the optimizer's
    create_state, make_optimizer config, and building both
    Learner, UpdateConfig        the policy (and critic) states with one RL step's compiled
                                 score, advantages and update; the update's epochs and
                                 mini-batches
    NonFiniteParamsError         an update that left non-finite params (names the step and
                                 the last finite checkpoint)
    trajectories_to_batch,       trajectories -> the padded batch the update reads; the
    NO_LOSS                      Trajectory.info flag of a row kept for shape, not loss
    bucket_length                the length bucket a sequence is padded to
"""

from rl_tpu.lazy_api import lazy_api, public_names

_HOMES = {
    ".state": ("TrainState", "OptimConfig", "create_state", "make_optimizer"),
    ".learner": ("Learner", "UpdateConfig", "NonFiniteParamsError"),
    ".rollout_batch": ("trajectories_to_batch", "NO_LOSS"),
    ".batching": ("bucket_length",),
}
__all__ = public_names(_HOMES)
__getattr__, __dir__ = lazy_api(__name__, _HOMES)
