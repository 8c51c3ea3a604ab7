"""The device side of an RL step: score a rollout batch, compute advantages, update.

Shape letters: B rows, T length bucket, E epochs, N minibatches.

Each phase takes and returns a `RolloutBatch` (rl_tpu/core/batch.py, where every array's dtype,
shape and reader is declared); a mapping of arrays by field name is taken as one, checked.

`Learner` holds what the update changes (the policy's TrainState, the critic's for PPO), the
frozen reference policy when a KL term needs it, and one compiled function per phase:

  score(batch)       proximal log-probs (`old_logprobs`: the policy at the start of this update;
                     skipped with `recompute_proximal=False`, the behaviour log-probs then
                     standing in, and at one epoch of one minibatch without LoRA dropout,
                     where the policy step takes its own: `proximal_from_step`), reference
                     log-probs, critic values; forward passes only.
  advantages(batch)  the configured estimator over the whole (global) batch: group statistics
                     and whitening see every row of every host, because jnp reductions on a
                     sharded array are global under jit.
  update(batch)      E epochs x N minibatches of the jitted policy step inside ONE compiled
                     call (`lax.scan` over minibatches), then the same for the value step.
                     States are donated; the batch is not.

Every function is compiled once per length bucket (jit's shape cache). Micro-batches are
counted by hand (`step.micro_batches`, `score_micro_batches`) or derived per bucket from a
tokens-per-device budget (`tokens_per_device`, `score_tokens_per_device`): a long bucket then
takes more, smaller micro-batches than a short one, at the same peak memory. Each epoch draws a
fresh permutation of the rows (seeded by `shuffle_seed` and the RL step), then minibatch n
takes rows n, n+N, n+2N... of the permuted batch (strided, like micro-batches). Without
shuffling (`shuffle=False`, or one minibatch and one epoch) no row moves between devices.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from rl_tpu import parallel
from rl_tpu.core.batch import (MODEL_INPUTS, POLICY, ROUTING_INPUT, VALUE, RolloutBatch,
                               abstract_batch, update_fields)
from rl_tpu.models import lora
from rl_tpu.models.transformer import Transformer
from rl_tpu.models.value import ValueModel
from rl_tpu.rl.advantages import compute_advantages
from rl_tpu.rl.losses import POLICY_LOSSES, PolicyLossConfig, kl_penalty
from rl_tpu.rl.masked import combine_stacked, metric_values
from rl_tpu.train import steps
from rl_tpu.train.state import TrainState, all_finite, shardings_of


@dataclasses.dataclass(frozen=True)
class UpdateConfig:
    epochs: int = 1
    minibatches: int = 1
    score_micro_batches: int = 1  # the score pass's micro-batches over the whole batch
    step: steps.StepConfig = steps.StepConfig()
    # Micro-batches from a token budget (> 0) instead of the counts above: for each length
    # bucket, the fewest micro-batches whose rows x T on one device fit it
    # (steps.micro_batches_for). `tokens_per_device` is the update's (policy and value steps),
    # `score_tokens_per_device` the forward passes' (proximal, reference, values).
    tokens_per_device: int = 0
    score_tokens_per_device: int = 0
    advantage: str = "grpo"
    advantage_options: tuple = ()  # (name, value) pairs for compute_advantages
    value_clip: Optional[float] = 0.2
    use_reference: bool = False  # score reference log-probs (KL loss or KL-shaped rewards)
    reward_kl_coef: float = 0.0  # REINFORCE++: KL to the reference folded into the reward
    recompute_proximal: bool = True  # False: behaviour log-probs stand in for the proximal
    shuffle: bool = True  # a fresh row permutation every epoch (when E x N > 1)
    shuffle_seed: int = 0

    def __post_init__(self):
        if self.epochs < 1 or self.minibatches < 1:
            raise ValueError(f"train.epochs={self.epochs} and train.minibatches="
                             f"{self.minibatches} must be >= 1")
        if self.tokens_per_device < 0 or self.score_tokens_per_device < 0:
            raise ValueError(f"train.tokens_per_device={self.tokens_per_device} and "
                             f"train.score_tokens_per_device={self.score_tokens_per_device}: "
                             "use 0 (count micro-batches by hand) or a positive token budget")


class NonFiniteParamsError(FloatingPointError):
    """Params that hold NaN or inf after an update: the run diverged and stops."""

    @classmethod
    def after_update(cls, step: int, which: list[str], last_checkpoint: Optional[int]):
        """The error of a run whose `which` params are non-finite after step `step`, raised
        before anything saves them; `last_checkpoint`: the latest step saved (None: none)."""
        if last_checkpoint is None:
            where, rerun = "no checkpoint was saved before it", "starts over"
        else:
            where = f"the last checkpoint, step {last_checkpoint}, holds finite params"
            rerun = "resumes from that checkpoint"
        return cls(f"step {step}: the {' and '.join(which)} params hold NaN or inf after the "
                   f"update, so the run stops here; {where}. Train again with a lower optim.lr "
                   f"or with optim.grad_clip set, in a new --workdir (a rerun of this one {rerun} "
                   "with the same config and diverges the same way)")


def reduce_metrics(stacked) -> dict[str, float]:
    """Tagged metrics of E x N updates ({name: Metric [E*N]}, on the host) -> one number each,
    each combined by its own reduction (token-weighted means, counts, extremes)."""
    return {k: float(v) for k, v in metric_values(combine_stacked(stacked)).items()}


def _split_minibatches(batch, n: int):
    return steps.split_micro_batches(batch, n) if n > 1 else jax.tree.map(lambda x: x[None], batch)


class Learner:
    """Policy (+ critic) states and the compiled score / advantages / update functions."""

    def __init__(self, model: Transformer, policy: TrainState, mesh: Mesh,
                 loss_cfg: PolicyLossConfig, cfg: UpdateConfig, *,
                 critic: Optional[TrainState] = None, value_model: Optional[ValueModel] = None,
                 reference_params: Any = None):
        if cfg.use_reference and reference_params is None:
            raise ValueError("a KL term is on but no reference params were given")
        if (critic is None) != (value_model is None):
            raise ValueError("give both critic (TrainState) and value_model, or neither")
        self.model, self.mesh, self.loss_cfg, self.cfg = model, mesh, loss_cfg, cfg
        self.policy, self.critic, self.value_model = policy, critic, value_model
        self.reference_params = reference_params
        self._batch_sharding = NamedSharding(mesh, parallel.batch_spec(1))
        self._replicated = NamedSharding(mesh, P())
        self._data_parallel = parallel.data_parallel_size(mesh)
        self._advantages = jax.jit(self._advantages_fn, out_shardings=self._batch_sharding)
        self._programs: dict[tuple, Any] = {}  # (phase, micro-batches) -> jitted function
        self._ahead: Optional[concurrent.futures.Future] = None  # compile_ahead's, until read

    def reference(self):
        """The KL reference's params: `reference_params` as given, or, given as adapters alone
        (a LoRA policy's adapters at the start), those adapters on the policy's own frozen base,
        so that a chip holds one copy of the base, not two."""
        ref = self.reference_params
        if ref is not None and not lora.without_adapters(ref):
            return lora.merge_into(self.policy.params, ref)
        return ref

    # -- micro-batches and programs -------------------------------------------------------

    def row_multiple(self) -> int:
        """What a global batch's rows must be a multiple of: data-parallel shards x minibatches
        x counted micro-batches (and the score pass's count). A budget picks its micro-batches
        among the divisors of each device's rows, so it needs shards x minibatches only."""
        cfg = self.cfg
        split = cfg.minibatches * (1 if cfg.tokens_per_device else cfg.step.micro_batches)
        if not (cfg.score_tokens_per_device or cfg.tokens_per_device):
            split = math.lcm(split, cfg.score_micro_batches)
        return self._data_parallel * split

    def score_micro_batches(self, rows: int, length: int) -> int:
        """Micro-batches of the forward passes over a [rows, length] global batch."""
        budget = self.cfg.score_tokens_per_device or self.cfg.tokens_per_device
        if not budget:
            return self.cfg.score_micro_batches
        return steps.micro_batches_for(rows // self._data_parallel, length, budget)

    def update_micro_batches(self, rows: int, length: int) -> int:
        """Micro-batches of each minibatch's step over a [rows, length] global batch."""
        if not self.cfg.tokens_per_device:
            return self.cfg.step.micro_batches
        per_device = rows // (self._data_parallel * self.cfg.minibatches)
        return steps.micro_batches_for(per_device, length, self.cfg.tokens_per_device)

    def program(self, phase: str, rows: int, length: int):
        """The jitted function of `phase` (logprobs, ref_logprobs, values, policy_update,
        value_update) for a [rows, length] batch, built once per micro-batch count (scored
        in micro-batches of their own: the whole batch at once would hold minibatches times
        the activations of one update micro-batch). jit's cache adds one compile per shape."""
        forward = phase in ("logprobs", "ref_logprobs", "values")
        m = (self.score_micro_batches if forward else self.update_micro_batches)(rows, length)
        key = ("logprobs" if phase == "ref_logprobs" else phase, m)
        if key not in self._programs:
            self._programs[key] = self._build(key[0], m)
        return self._programs[key]

    def _build(self, phase: str, m: int):
        step_cfg = dataclasses.replace(self.cfg.step, micro_batches=m)
        if phase == "logprobs":  # the policy's and the reference's (same shardings)
            fn = steps.make_logprob_fn(self.model, step_cfg, with_entropy=False)
            return steps.compile_logprob_fn(fn, self.policy.params, self.mesh)
        if phase == "values":
            return jax.jit(functools.partial(_critic_values, self.value_model, m),
                           in_shardings=(shardings_of(self.critic.params),
                                         self._batch_sharding),
                           out_shardings=self._batch_sharding)
        tagged = dataclasses.replace(step_cfg, tagged_metrics=True,
                                     proximal_from_step=self.proximal_from_step)
        if phase == "policy_update":
            return self._compile_update(
                steps.make_policy_step(self.model, self.loss_cfg, tagged), self.policy)
        if phase == "value_update":
            value_step = steps.make_value_step(self.value_model, self.cfg.value_clip,
                                               "token_mean", tagged)
            return self._compile_update(value_step, self.critic)
        raise ValueError(f"unknown learner phase {phase!r}")

    # -- phases ---------------------------------------------------------------------------

    @property
    def proximal_from_step(self) -> bool:
        """One epoch of one minibatch: the update runs on the very params a score pass would
        use, so the policy step takes its own log-probs (stop-gradient) as the proximal ones,
        exactly, and the score pass skips them: one forward pass less per RL step (TRL does
        the same at num_iterations=1). Not for a loss with whole-batch statistics (BAPO reads
        them in its own pass), a KL-shaped reward (the advantages read old_logprobs), or LoRA
        dropout: the step's forward drops adapter inputs, so its log-probs would carry the
        masks' noise into the importance weights, the masks and approx_kl; the score pass runs
        without dropout."""
        cfg = self.cfg
        return (cfg.recompute_proximal and cfg.epochs * cfg.minibatches == 1
                and POLICY_LOSSES.get(self.loss_cfg.kind).batch_statistics is None
                and not cfg.reward_kl_coef and not steps.lora_dropout(self.model))

    def score(self, batch) -> RolloutBatch:
        """Adds old_logprobs (unless `proximal_from_step`; and ref_logprobs, values) to a
        global batch. Without a proximal pass (`recompute_proximal=False`) the batch must
        carry behaviour_logprobs, which the recipe puts in only when they are of the full
        distribution (recipes/algorithms.py, `batch_keys`)."""
        self._join_ahead()
        needs = () if self.cfg.recompute_proximal else ("behaviour_logprobs",)
        batch = RolloutBatch.of(batch).check(needs, why="recompute_proximal=False: the "
                                             "engine's log-probs stand in for the proximal")
        inputs = {k: batch[k] for k in self.model_inputs()}
        shape = batch.tokens.shape
        out = {}
        if self.proximal_from_step:
            pass
        elif self.cfg.recompute_proximal:
            logprobs = self.program("logprobs", *shape)
            out["old_logprobs"], _ = logprobs(self.policy.params, inputs)
        else:
            out["old_logprobs"] = batch.behaviour_logprobs
        if self.reference_params is not None:
            out["ref_logprobs"], _ = self.program("ref_logprobs", *shape)(
                self.reference(), inputs)
        if self.critic is not None:
            out["values"] = self.program("values", *shape)(self.critic.params, inputs)
        return batch.replace(**out)

    def advantages(self, batch) -> RolloutBatch:
        """Adds advantages and returns [B, T] (global statistics over all rows)."""
        batch = RolloutBatch.of(batch)
        advantages, returns = self._advantages(batch)
        return batch.replace(advantages=advantages, returns=returns)

    def update(self, batch, step: int = 0) -> dict[str, float]:
        """E epochs x N minibatches of the policy step (then the value step); host metrics.
        `step` (the RL step) seeds the minibatch permutations."""
        self._join_ahead()
        batch = RolloutBatch.of(batch)
        keys = self.update_keys(batch)
        batch.check(keys)
        key = jax.random.fold_in(jax.random.key(self.cfg.shuffle_seed), step)
        shape = batch.tokens.shape
        self.policy, stacked = self.program("policy_update", *shape)(
            self.policy, batch.only(keys), key)
        metrics = {f"train/{k}": v for k, v in reduce_metrics(jax.device_get(stacked)).items()
                   if self.cfg.recompute_proximal or not k.startswith("logprob_gap_")}
        # (without a proximal pass the behaviour log-probs stand in for it: a gap of 0 would
        # claim an agreement nobody measured, so it is not logged)
        metrics["train/micro_batches"] = float(self.update_micro_batches(*shape))
        if self.critic is not None:
            self.critic, stacked = self.program("value_update", *shape)(
                self.critic, batch.only(update_fields(VALUE)), key)
            metrics.update({f"critic/{k}": v
                            for k, v in reduce_metrics(jax.device_get(stacked)).items()})
        return metrics

    def non_finite_params(self) -> list[str]:
        """Which of "policy", "critic" hold NaN or inf in their params ([] when none): one
        jitted reduction and one scalar read, cheap enough for every step. A skipped update
        (non-finite loss or gradient) leaves params as they were; finite gradients with too
        large a step can still make them non-finite."""
        states = {"policy": self.policy, "critic": self.critic}
        params = {name: s.params for name, s in states.items() if s is not None}
        if bool(all_finite(params)):
            return []
        return [name for name, p in params.items() if not bool(all_finite(p))]

    def check_finite(self, step: int, last_checkpoint: Callable[[], Optional[int]]) -> None:
        """Raises NonFiniteParamsError naming step `step` and the last checkpoint (asked of
        `last_checkpoint()` only then) if the params are not finite after its update."""
        non_finite = self.non_finite_params()
        if non_finite:
            raise NonFiniteParamsError.after_update(step, non_finite, last_checkpoint())

    # -- compiling ahead ------------------------------------------------------------------

    def model_inputs(self) -> tuple[str, ...]:
        """What the score pass's forwards read: the tokens' arrays, and under routing replay
        the sampler's routed experts."""
        return MODEL_INPUTS + ((ROUTING_INPUT,) if self.cfg.step.routing_replay else ())

    def routing_shape(self) -> Optional[tuple[int, int]]:
        """(sparse layers, experts a token) of a mixture-of-experts policy, else None: the
        trailing dims of a batch's routed_experts."""
        moe = getattr(self.model.cfg, "moe", None)
        if moe is None:
            return None
        return len(moe.sparse_layers(self.model.cfg.num_layers)), moe.top_k

    def update_keys(self, batch_keys) -> list[str]:
        """The batch fields the policy update reads, given the fields a batch carries: those
        FIELDS says it reads (always, or when present), old_logprobs only when no step takes
        its own (`proximal_from_step`)."""
        keys = update_fields(POLICY, batch_keys)
        return [k for k in keys if not (k == "old_logprobs" and self.proximal_from_step)]

    def carried_fields(self, behaviour: bool = True) -> list[str]:
        """The fields a trainer's batch brings to this learner's update beyond those it always
        reads: ref_logprobs (its score pass adds them with a KL reference), Dr.GRPO's
        length_normalizer (the fixed_normalizer aggregation divides by it), the sampler's
        routed_experts under routing replay and, with `behaviour` (the engine reports
        full-distribution log-probs), behaviour_logprobs."""
        fields = ["behaviour_logprobs"] if behaviour else []
        fields += [ROUTING_INPUT] if self.cfg.step.routing_replay else []
        fields += ["ref_logprobs"] if self.reference_params is not None else []
        fields += (["length_normalizer"] if self.loss_cfg.aggregation == "fixed_normalizer"
                   else [])
        return fields

    def phases(self) -> list[str]:
        """The programs `score` and `update` run, in the order they run them."""
        out = ["logprobs"] if self.cfg.recompute_proximal and not self.proximal_from_step else []
        out += ["ref_logprobs"] if self.reference_params is not None else []
        out += ["values"] if self.critic is not None else []
        return out + ["policy_update"] + (["value_update"] if self.critic is not None else [])

    def lower(self, phase: str, rows: int, length: int, batch_keys: Sequence[str] = ()):
        """`phase`'s program (see `program`) for a [rows, length] batch carrying `batch_keys`
        (the fields the update reads when present, e.g. behaviour_logprobs) as the trainer
        builds it, lowered against ShapeDtypeStructs of its inputs (core.batch.abstract_batch):
        nothing runs and nothing is allocated. What aot.check measures on a TPU topology and
        `compile_ahead` compiles here."""
        sharding = self._batch_sharding
        routing = self.routing_shape()
        inputs = dict(abstract_batch(rows, length, sharding, self.model_inputs(),
                                     routing=routing))
        # the key as `update` passes it: uncommitted (a committed replicated one is another
        # jit cache entry, so the program compiled ahead would go unused)
        key = jax.eval_shape(lambda: jax.random.key(0))
        program = self.program(phase, rows, length)
        if phase == "policy_update":
            batch = abstract_batch(rows, length, sharding, self.update_keys(batch_keys),
                                   routing=routing)
            return program.lower(_abstract(self.policy), batch, key)
        if phase in ("logprobs", "ref_logprobs"):
            params = self.policy.params if phase == "logprobs" else self.reference()
            return program.lower(_abstract(params), inputs)
        if phase == "values":
            return program.lower(_abstract(self.critic.params), inputs)
        if phase == "value_update":
            batch = abstract_batch(rows, length, sharding, update_fields(VALUE))
            return program.lower(_abstract(self.critic), batch, key)
        raise ValueError(f"unknown learner phase {phase!r}")

    def compile_ahead(self, rows: int, length: int,
                      batch_keys: Sequence[str] = ()) -> concurrent.futures.Future:
        """Compiles the programs a [rows, length] batch carrying `batch_keys` will run
        (`phases`) on a background thread, and returns at once: the caller samples the first
        rollout meanwhile, and XLA (which releases the GIL while it compiles) uses a core
        the sampler leaves. jit's cache then holds them, so the first `score` / `update` at
        that shape compiles nothing; both wait for this first (two compiles of one program
        at once would both run). A batch of another shape compiles as it would have: the
        guess costs background compile time, never a wrong program. The future's result:
        the phases compiled; its exception is raised by the next `score` / `update` too."""
        self._join_ahead()
        phases = self.phases()
        for phase in phases:  # the jitted functions built here: the thread only reads them
            self.program(phase, rows, length)

        def compile_all():
            for phase in phases:
                self.lower(phase, rows, length, batch_keys).compile()
            return phases

        self._ahead = _AHEAD.submit(compile_all)
        return self._ahead

    def _join_ahead(self) -> None:
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.result()

    # -- compiled pieces ------------------------------------------------------------------

    def _advantages_fn(self, batch):
        cfg = self.cfg
        inputs = dict(batch)
        options = dict(cfg.advantage_options)
        if cfg.reward_kl_coef and "ref_logprobs" in batch:
            # REINFORCE++'s KL-shaped reward: log pi_old - log pi_ref on the policy's tokens.
            inputs["kl"] = kl_penalty(batch["old_logprobs"], batch["ref_logprobs"], "k1")
            options["kl_coef"] = cfg.reward_kl_coef
        return compute_advantages(cfg.advantage, inputs, **options)

    def _compile_update(self, step_fn, state: TrainState):
        epochs, n = self.cfg.epochs, self.cfg.minibatches
        shuffle = self.cfg.shuffle and epochs * n > 1

        batch_sharding = self._batch_sharding

        def sharded_step(state, minibatch):  # the scan's slice keeps the rows' sharding
            return step_fn(state, jax.lax.with_sharding_constraint(minibatch, batch_sharding))

        def update(state, batch, key):
            def one_epoch(state, epoch_key):
                rows = batch
                if shuffle:  # PPO's per-epoch reshuffle: other rows share a minibatch each time
                    perm = jax.random.permutation(epoch_key, batch["tokens"].shape[0])
                    # A gather by a traced permutation has no sharding XLA can infer: left
                    # alone it replicated the permuted batch, and every minibatch step then
                    # ran on all rows on every device. Re-shard the rows (an all-to-all of
                    # the batch, small next to the step's activations).
                    rows = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(
                        jnp.take(x, perm, axis=0), batch_sharding), batch)
                return jax.lax.scan(sharded_step, state, _split_minibatches(rows, n))

            state, metrics = jax.lax.scan(one_epoch, state, jax.random.split(key, epochs))
            return state, jax.tree.map(lambda m: m.reshape(-1), metrics)  # [E*N]

        state_shardings = shardings_of(state)
        return jax.jit(update,
                       in_shardings=(state_shardings, self._batch_sharding, self._replicated),
                       out_shardings=(state_shardings, self._replicated), donate_argnums=0)


# One thread: compiles ahead queue behind each other rather than take both cores from a
# sampler that is running its own.
_AHEAD = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rl_tpu-compile-ahead")


def _abstract(tree):
    """Arrays (or ShapeDtypeStructs) -> ShapeDtypeStructs of the same shardings."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                       sharding=getattr(x, "sharding", None)),
                        tree)


def _critic_values(value_model: ValueModel, micro_batches: int, params, batch):
    """values[t] [B, T]: the critic's estimate for token t from the hidden state at t-1 (the
    value step's alignment; entry 0 is 0), in `micro_batches` forward passes."""
    def values(micro):
        out = value_model.apply({"params": params}, micro["tokens"], micro.get("positions"),
                                micro.get("segment_ids"))
        return jnp.concatenate([jnp.zeros_like(out[:, :1]), out[:, :-1]], axis=1)

    if micro_batches == 1:
        return values(batch)
    out = jax.lax.map(values, steps.split_micro_batches(batch, micro_batches))  # [M, B/M, T]
    return out.swapaxes(0, 1).reshape(batch["tokens"].shape)
