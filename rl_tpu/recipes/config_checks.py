"""`check(config)`: the cross-key checks no single field of the config can make, run by every
launcher before anything compiles or writes to the workdir. Each error names the keys to change
and what to set them to. The config itself (its blocks, defaults and presets) is
rl_tpu/recipes/config.py, which re-exports `check`.
"""

from __future__ import annotations

import ml_collections

from rl_tpu import schedules
from rl_tpu.agent import branching, program
from rl_tpu.core import env as envs
from rl_tpu.env_serving.remote import parse_urls as parse_env_urls
from rl_tpu.models.fused_attention import SPLASH_BLOCK
from rl_tpu.offpolicy.replay import ReplayConfig
from rl_tpu.recipes.algorithms import (ALGORITHMS, algo_config, estimator_use, loss_config,
                                      records_routing)
from rl_tpu.recipes.policy_io import lora_config
from rl_tpu.rewards.judge_reward import JUDGE_MODES
from rl_tpu.rewards.mix import TRANSFORMS
from rl_tpu.rollout.http_transport import normalise_url
from rl_tpu.train.state import SCHEDULES


# Keys whose defaults differ between algorithms: the ones a bare rename of algo.name leaves stale.
_NAME_DEPENDENT = tuple(k for k in algo_config(ALGORITHMS[0]) if k != "name"
                        and len({repr(algo_config(n)[k]) for n in ALGORITHMS}) > 1)

# Counts below which a run makes no sense (train.steps = 0 is an SFT-only run; see check).
_AT_LEAST = {"train.steps": 0, "train.tasks_per_step": 1, "train.samples_per_task": 1,
             "train.epochs": 1, "train.minibatches": 1, "train.micro_batches": 1,
             "train.score_micro_batches": 0, "train.tokens_per_device": 0,
             "train.score_tokens_per_device": 0, "rollout.kv_tokens_per_device": 0,
             "rollout.max_batch": 1, "rollout.sampler_tensor": 0, "rollout.prefill_chunk": 0,
             "eval.num_tasks": 1, "eval.every": 1, "checkpoint.every": 1, "checkpoint.keep": 1,
             "sft.steps": 0, "env.max_new_tokens": 1, "env.max_turns": 1,
             "eval.max_turns": 0, "eval.pass_k": 0, "algo.max_refill_rounds": 0,
             "algo.overlong_buffer": 0}

# The seed's range: numpy's RandomState (the SFT batches' order) takes seeds below 2**32, and
# the recipes add round numbers to it; JAX's keys overflow past 2**63.
SEED_LIMIT = 2**31


def warmup_shapes(text: str) -> list[tuple[int, int, int]]:
    """`rollout.warmup` ("256x512x512,64x4096x512") as (rows, prompt, new tokens) triples."""
    shapes = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        try:
            rows, prompt, new = (int(x) for x in part.lower().split("x"))
            if min(rows, prompt, new) < 1:
                raise ValueError
        except ValueError:
            raise ValueError(f"rollout.warmup={text!r}: {part!r} is not ROWSxPROMPTxNEW with "
                             f"three positive integers, e.g. 256x512x512") from None
        shapes.append((rows, prompt, new))
    return shapes


def _check_counts(config: ml_collections.ConfigDict) -> None:
    for key, low in _AT_LEAST.items():
        block, _, leaf = key.partition(".")
        value = config[block][leaf]
        if value < low:
            raise ValueError(f"{key}={value} must be >= {low}")
    if config.train.steps == 0 and config.sft.steps == 0:
        raise ValueError("train.steps=0 and sft.steps=0: nothing would be trained; set "
                         "train.steps >= 1 (RL steps), or sft.steps >= 1 for an SFT-only run")


def _check_ranges(config: ml_collections.ConfigDict) -> None:
    """Numbers no loss, estimator or env refuses by itself, each of which would train on
    nonsense (a negative KL coefficient rewards moving away from the reference; a discount
    or GAE lambda outside [0, 1] makes returns grow with distance) or fail only once the run
    has compiled and written to its workdir."""
    if not 0 <= config.seed < SEED_LIMIT:
        raise ValueError(f"seed={config.seed} must be in [0, 2**31) (numpy's RandomState "
                         "takes 32-bit seeds, and the recipes add round numbers to it)")
    a = config.algo
    for key in ("kl_coef", "reward_kl_coef", "value_clip", "overlong_penalty"):
        if a[key] < 0:
            raise ValueError(f"algo.{key}={a[key]} must be >= 0 (0 = off)")
    for key in ("gamma", "lam"):
        if not 0 <= a[key] <= 1:
            raise ValueError(f"algo.{key}={a[key]} must be in [0, 1] (1 = no discount)")
    if a.std_ddof not in (0, 1):
        raise ValueError(f"algo.std_ddof={a.std_ddof}: choose 1 (the unbiased group std) or 0 "
                         "(the population std)")
    e = config.env
    if not e.step_timeout_s > 0 or e.step_latency_s < 0:
        raise ValueError(f"env.step_timeout_s={e.step_timeout_s} must be > 0 and "
                         f"env.step_latency_s={e.step_latency_s} >= 0")
    if not isinstance(e.max_failed_steps, int) or e.max_failed_steps < 0:
        raise ValueError(f"env.max_failed_steps={e.max_failed_steps!r} must be an int >= 0 "
                         "(steps in a row whose episodes all fail before the run stops; 0 never)")
    r = config.train.replay  # its own checks, here rather than after the warm start
    ReplayConfig(capacity=r.capacity, fraction=r.fraction, max_staleness=r.max_staleness)


def _check_algo_block(algo: ml_collections.ConfigDict) -> None:
    ours = algo_config(algo.name)
    if (algo.advantage, algo.loss) == (ours.advantage, ours.loss):
        return
    for other in ALGORITHMS:
        theirs = algo_config(other)
        if all(algo[k] == theirs[k] for k in _NAME_DEPENDENT):
            raise ValueError(
                f"algo.name={algo.name!r} but the algo block holds {other!r}'s defaults "
                f"(algo.advantage={algo.advantage!r}, algo.loss={algo.loss!r}; {algo.name!r} "
                f"has {ours.advantage!r}, {ours.loss!r}): algo.name was changed without its "
                f"block. Use rl_tpu.recipes.config.set_algo(config, {algo.name!r}) (the "
                "launchers do so for --config.algo.name), or set algo.name back")


def _check_env(config: ml_collections.ConfigDict) -> None:
    name, kwargs = config.env.name, config.env.kwargs.to_dict()
    known = envs.kwargs_of(name)
    unknown = sorted(set(kwargs) - set(known)) if known is not None else []
    if unknown:  # most often env.name set alone, the kwargs still another env's
        raise ValueError(f"env.kwargs {', '.join(unknown)}: env {name!r} takes no such keyword "
                         f"argument (its kwargs: {', '.join(known) or 'none'}); a config that "
                         "changes env.name should call rl_tpu.recipes.config.set_env, which "
                         "gives env.kwargs that env's kwargs")
    envs.check_kwargs(name, kwargs)  # and those it needs


# Rates that must be positive, and the sampling settings' ranges (each read by the trainer's
# optimizers or sampler only after the run has written to its workdir, so checked here).
_POSITIVE = ("optim.lr", "sft.lr", "loop.sft_lr", "dpo.lr", "algo.value_lr")
_NOT_NEGATIVE = ("optim.warmup_steps", "optim.weight_decay", "optim.grad_clip",
                 "sft.warmup_steps", "sft.group_by_length", "rollout.sampler_devices")


def _check_rates(config: ml_collections.ConfigDict) -> None:
    for key in _POSITIVE + _NOT_NEGATIVE:
        block, _, leaf = key.partition(".")
        value = config[block][leaf]
        if key in _POSITIVE and not value > 0:
            raise ValueError(f"{key}={value} must be > 0 (a learning rate); e.g. {key}=1e-5")
        if key in _NOT_NEGATIVE and value < 0:
            raise ValueError(f"{key}={value} must be >= 0")
    if config.optim.schedule not in SCHEDULES:
        raise ValueError(f"optim.schedule={config.optim.schedule!r}; choose one of {SCHEDULES}")
    s = config.sft
    for key in ("batch_size", "num_demos", "max_length"):
        if s[key] < 1:
            raise ValueError(f"sft.{key}={s[key]} must be >= 1")
    if not 0 <= s.teacher_skill <= 1:
        raise ValueError(f"sft.teacher_skill={s.teacher_skill} must be in [0, 1] (how often "
                         "the teacher's demonstrations are right)")
    r = config.rollout
    if not r.temperature > 0:
        raise ValueError(f"rollout.temperature={r.temperature} must be > 0: rollouts sample at "
                         "it and the trainer divides the logits by it to recompute log-probs "
                         "(evals are greedy whatever it is); 1.0 samples the model as it is")
    if not 0 < r.top_p <= 1:
        raise ValueError(f"rollout.top_p={r.top_p} must be in (0, 1] (1 = no truncation)")
    if r.top_k == 0 or r.top_k < -1:
        raise ValueError(f"rollout.top_k={r.top_k} must be -1 (every token) or >= 1")


def _check_urls(config: ml_collections.ConfigDict) -> None:
    """Each URL well formed, without any network: a rollout server's http(s)://host:port (it
    always has a port), an env server's the same, or host:port. A bare word ('garbage') is a
    mistake, not a host name to look up."""
    for url in (u.strip() for u in config.rollout.urls.split(",") if u.strip()):
        try:
            normalise_url(url)
        except ValueError as e:
            raise ValueError(f"rollout.urls (--rollout_urls): {e}; give comma-separated "
                             "http://host:port of SGLang-compatible servers") from None
    for url in (u.strip() for u in config.env.remote_url.split(",") if u.strip()):
        host_port = url.split("://", 1)[-1].rstrip("/")
        if "://" not in url and ":" not in host_port:
            raise ValueError(f"env.remote_url: {url!r} is not a URL; give the env server's "
                             "http://host:port (e.g. http://127.0.0.1:36001, where `python -m "
                             "launch.serve_env --env NAME` serves by default)")


def _check_remote_env(env: ml_collections.ConfigDict) -> None:
    if not env.remote_url:
        return
    parse_env_urls(env.remote_url)  # each one http(s)://host[:port]
    if not 0 < env.remote_timeout_s <= env.step_timeout_s:
        raise ValueError(f"env.remote_timeout_s={env.remote_timeout_s} must be > 0 and <= "
                         f"env.step_timeout_s={env.step_timeout_s} (the limit on a whole env "
                         "call, retries included)")
    if env.remote_retries < 0 or env.remote_backoff_s < 0:
        raise ValueError(f"env.remote_retries={env.remote_retries} and env.remote_backoff_s="
                         f"{env.remote_backoff_s} must be >= 0")


RECIPES = ("rl", "sft", "expert_iteration", "rloop", "dpo", "selfplay", "reward_model")


def _check_loop(config: ml_collections.ConfigDict) -> None:
    loop, dpo = config.loop, config.dpo
    for key in ("rounds", "tasks_per_round", "samples_per_task", "sft_steps", "sft_batch_size"):
        if loop[key] < 1:
            raise ValueError(f"loop.{key}={loop[key]} must be >= 1")
    if loop.max_per_task < 0 or loop.max_examples < 0:
        raise ValueError("loop.max_per_task and loop.max_examples must be >= 0 (0 = no cap)")
    if loop.rft_from not in ("start", "end"):
        raise ValueError(f"loop.rft_from={loop.rft_from!r}; choose 'start' (RLoop: fine-tune "
                         "the RL phase's starting weights) or 'end' (RL <-> SFT alternation)")
    if dpo.loss not in ("dpo", "ipo", "inpo"):
        raise ValueError(f"dpo.loss={dpo.loss!r}; choose dpo, ipo or inpo")
    if dpo.beta <= 0 or dpo.steps < 1 or dpo.batch_size < 1 or dpo.epochs < 0:
        raise ValueError(f"dpo.beta={dpo.beta}, dpo.steps={dpo.steps}, dpo.batch_size="
                         f"{dpo.batch_size}: each must be > 0; dpo.epochs={dpo.epochs} >= 0")
    if dpo.loss == "inpo" and not 0 <= dpo.inpo_tau / dpo.beta <= 1:
        raise ValueError(f"dpo.loss='inpo' needs 0 <= eta*tau <= 1 with eta = 1/dpo.beta: "
                         f"dpo.inpo_tau={dpo.inpo_tau} / dpo.beta={dpo.beta} = "
                         f"{dpo.inpo_tau / dpo.beta}")
    sp = config.selfplay
    if sp.solver_samples < 2 or not 0 < sp.target_success < 1:
        raise ValueError(f"selfplay.solver_samples={sp.solver_samples} must be >= 2 (a solver "
                         f"group) and selfplay.target_success={sp.target_success} in (0, 1)")
    rewards = ("peak", "learnability", "band")  # recipes/selfplay.PROPOSER_REWARDS
    if sp.proposer_reward not in rewards or not 0 <= sp.band_low <= sp.band_high <= 1:
        raise ValueError(f"selfplay.proposer_reward={sp.proposer_reward!r} must be one of "
                         f"{rewards}, and selfplay.band_low={sp.band_low} <= "
                         f"selfplay.band_high={sp.band_high} within [0, 1]")
    if config.recipe == "dpo" and not dpo.data_path and loop.samples_per_task < 2:
        raise ValueError("online DPO pairs the best and worst of a prompt's replies: set "
                         "loop.samples_per_task >= 2")


def _check_reward(config: ml_collections.ConfigDict) -> None:
    r = config.reward
    if r.model_transform not in TRANSFORMS:
        raise ValueError(f"reward.model_transform={r.model_transform!r}; choose one of "
                         f"{TRANSFORMS}")
    if r.tokens_per_batch < 16:
        raise ValueError(f"reward.tokens_per_batch={r.tokens_per_batch} must be >= 16")
    offline = " with offline pairs (dpo.data_path)" if config.recipe == "dpo" else ""
    for key in ("model_path", "urls"):
        if r[key] and not (config.recipe == "rl" or (config.recipe == "dpo"
                                                     and not config.dpo.data_path)):
            raise ValueError(f"reward.{key} is read by the RL recipe and by online DPO (it "
                             f"ranks the sampled replies), not by recipe={config.recipe!r}"
                             f"{offline}; leave it empty")
    if r.model_path and r.urls:
        raise ValueError(f"reward.model_path={r.model_path!r} and reward.urls={r.urls!r}: the "
                         "reward model runs here or on its servers, not both; leave one empty")
    if r.urls:
        # import cost: the reward client module loads the reward server's web stack (~2.7 s)
        from rl_tpu.rewards.remote import parse_urls
        parse_urls(r.urls)  # each http(s)://host:port, none twice; names reward.urls
    if r.judge not in JUDGE_MODES:
        raise ValueError(f"reward.judge={r.judge!r}; choose one of {JUDGE_MODES} (\"\" = none)")
    if r.judge and config.recipe != "rl":
        raise ValueError(f"reward.judge is read by the RL recipe, not by recipe="
                         f"{config.recipe!r}; leave it empty")
    if r.judge_model_path and not r.judge:
        raise ValueError(f"reward.judge_model_path={r.judge_model_path!r} names a judge, but "
                         "reward.judge is empty: set reward.judge='pointwise'")
    if r.judge == "pairwise" and config.train.samples_per_task < 2:
        raise ValueError("reward.judge='pairwise' compares the samples of a task: set "
                         "train.samples_per_task >= 2")
    if r.judge_max_new_tokens < 4:
        raise ValueError(f"reward.judge_max_new_tokens={r.judge_max_new_tokens} must be >= 4: "
                         "room for a verdict like [[YES]]")


def _check_lora(config: ml_collections.ConfigDict) -> None:
    """model.lora.*: every field (the sampler's mode too), built into the LoraConfig the
    recipes will build from it, so that a bad one fails before anything compiles; nothing
    with rank 0 (LoRA off)."""
    lora_config(config)


def _check_reward_model(config: ml_collections.ConfigDict) -> None:
    rm = config.reward_model
    for key in ("prompts", "eval_prompts", "steps", "batch_size", "calibration_bins",
                "ssrm_pool"):
        if rm[key] < 1:
            raise ValueError(f"reward_model.{key}={rm[key]} must be >= 1")
    if rm.epochs < 0 or rm.ssrm_rounds < 0 or rm.centring < 0 or not rm.lr > 0:
        raise ValueError(f"reward_model.epochs={rm.epochs}, ssrm_rounds={rm.ssrm_rounds} and "
                         f"centring={rm.centring} must be >= 0, lr={rm.lr} > 0")
    if not 0 <= rm.eval_fraction < 1:
        raise ValueError(f"reward_model.eval_fraction={rm.eval_fraction} must be in [0, 1): "
                         "the share of a JSONL's pairs without a split held out to measure "
                         "the model")
    if not 0.5 <= rm.ssrm_threshold <= 1:
        raise ValueError(f"reward_model.ssrm_threshold={rm.ssrm_threshold} must be in [0.5, 1] "
                         "(a confidence sigmoid(|r_a - r_b|) is never below 0.5)")
    if (config.recipe == "reward_model" and not rm.data_path
            and config.loop.samples_per_task < 2):
        raise ValueError("reward_model pairs from the env compare a task's replies: set "
                         "loop.samples_per_task >= 2 (or give reward_model.data_path)")


def _check_selfplay_without_partial_rollouts(config: ml_collections.ConfigDict) -> None:
    """Self-play's game (proposals, then their solver groups, then the proposers' rewards) is
    one step's rollout; partial rollouts pause episodes across steps and play them as plain
    episodes, so proposers would train on reward 0."""
    if config.recipe == "selfplay" and config.rollout.partial_token_budget:
        raise ValueError(f"recipe='selfplay' with rollout.partial_token_budget="
                         f"{config.rollout.partial_token_budget}: partial rollouts play plain "
                         "episodes, not the proposer/solver game (proposers would keep reward "
                         "0); set rollout.partial_token_budget=0")


def check(config: ml_collections.ConfigDict) -> None:
    """Cross-key checks that no single field can make; each error names the keys to change."""
    # First, every number finite: a NaN or inf lr, clip bound or coefficient makes no error of
    # its own (comparisons with NaN are False), it trains on garbage.
    def not_finite(node, name: str) -> list[str]:
        if isinstance(node, float):  # np.float64 too; a bool or an int is always finite
            return [] if -float("inf") < node < float("inf") else [f"{name}={node}"]
        if isinstance(node, (ml_collections.ConfigDict, dict)):
            items = [(f"{name}.{k}" if name else str(k), v) for k, v in node.items()]
        elif isinstance(node, (list, tuple)):
            items = [(f"{name}[{i}]", v) for i, v in enumerate(node)]
        else:
            return []
        return [bad for key, value in items for bad in not_finite(value, key)]

    bad = not_finite(config, "")
    if bad:
        raise ValueError(f"{', '.join(bad)}: config values must be finite numbers; give "
                         f"{'that key' if len(bad) == 1 else 'those keys'} a finite value")
    _check_ranges(config)
    program.check_config(config)  # env agent_program: what a program's episodes cannot do
    if config.recipe not in RECIPES:
        raise ValueError(f"recipe={config.recipe!r}; choose one of {RECIPES}")
    _check_lora(config)
    records_routing(config.algo)  # algo.routing_replay: a known mode
    _check_loop(config)
    _check_reward_model(config)
    _check_reward(config)
    if config.algo.name not in ALGORITHMS:
        raise ValueError(f"algo.name={config.algo.name!r}; choose one of {ALGORITHMS}")
    _check_algo_block(config.algo)
    try:  # the policy loss's own checks (bounds, modes and their combinations), at start-up
        loss_config(config.algo, config.env.max_new_tokens)
    except (ValueError, TypeError) as e:
        raise ValueError(f"algo: {e}") from e
    _check_counts(config)
    warmup_shapes(config.rollout.warmup)  # a malformed list fails here, not at start-up
    _check_rates(config)
    _check_env(config)
    _check_urls(config)
    _check_remote_env(config.env)
    if config.rollout.engine not in ("jax", "sglang"):
        raise ValueError(f"rollout.engine={config.rollout.engine!r}; choose 'jax' or 'sglang'")
    if config.rollout.engine == "sglang" and not config.rollout.urls:
        raise ValueError("rollout.engine='sglang' needs rollout.urls (or --rollout_urls)")
    if config.rollout.router_url:
        if config.rollout.engine != "sglang":
            raise ValueError("rollout.router_url needs rollout.engine='sglang' and rollout.urls "
                             "(the router's workers, which get weight updates directly)")
        try:
            normalise_url(config.rollout.router_url)
        except ValueError as e:
            raise ValueError(f"rollout.router_url: {e}") from e
    if config.rollout.max_staleness < 0:
        raise ValueError(f"rollout.max_staleness={config.rollout.max_staleness} must be >= 0 "
                         "(0 = on-policy)")
    r = config.rollout
    if (r.partial_token_budget or r.mask_stale_tokens) and (
            r.max_staleness < 1 or r.deterministic):
        raise ValueError("rollout.partial_token_budget and rollout.mask_stale_tokens need a "
                         "free-running asynchronous producer: set rollout.max_staleness >= 1 "
                         "and rollout.deterministic=False")
    if r.partial_token_budget < 0:
        raise ValueError(f"rollout.partial_token_budget={r.partial_token_budget} must be >= 0 "
                         "(0 = no partial rollouts)")
    off_policy = config.rollout.max_staleness > 0 or config.train.replay.capacity > 0
    if (off_policy and not config.algo.recompute_proximal
            and config.algo.ratio_against == "proximal"):
        raise ValueError("algo.recompute_proximal=False uses the behaviour log-probs as the "
                         "proximal policy, which off-policy data (rollout.max_staleness > 0 or "
                         "train.replay.capacity > 0) makes wrong for a ratio against the "
                         "proximal policy: set algo.recompute_proximal=True or "
                         "algo.ratio_against='behaviour'")
    estimator = estimator_use(config.algo.advantage)
    if estimator.group_based and config.train.samples_per_task < 2:
        raise ValueError(f"algo.advantage={config.algo.advantage!r} compares samples of a task: "
                         "set train.samples_per_task >= 2")
    if not estimator.partial_rollouts and r.partial_token_budget:
        raise ValueError(f"algo.advantage={config.algo.advantage!r} plays branching rollouts, "
                         "which partial rollouts cannot pause: set rollout.partial_token_budget=0")
    _check_selfplay_without_partial_rollouts(config)
    branching.BranchPlan(config.algo.branch_turn, config.algo.branch_sample)  # checks both
    sch = config.schedules
    schedules.check_budget(sch.budget, sch.budget_min, config.env.max_new_tokens,
                           sch.budget_period, sch.budget_start, sch.budget_stairs)
    if sch.budget and 0 < config.algo.overlong_buffer >= sch.budget_min:
        raise ValueError(f"algo.overlong_buffer={config.algo.overlong_buffer} must be below "
                         f"schedules.budget_min={sch.budget_min}, the shortest budget it is "
                         "measured against")
    if config.eval.max_new_tokens < 0:
        raise ValueError(f"eval.max_new_tokens={config.eval.max_new_tokens} must be >= 0 "
                         "(0 = env.max_new_tokens)")
    if config.env.max_new_tokens + 16 > config.env.max_context_tokens:
        raise ValueError(f"env.max_context_tokens={config.env.max_context_tokens} leaves no "
                         f"room for env.max_new_tokens={config.env.max_new_tokens} and a prompt")
    odd = [b for b in config.train.length_buckets if b > SPLASH_BLOCK and b % SPLASH_BLOCK]
    if config.model.attention_impl == "splash" and odd:
        raise ValueError(f"model.attention_impl='splash' runs in blocks of {SPLASH_BLOCK} tokens: "
                         f"train.length_buckets {odd} are not multiples of {SPLASH_BLOCK} (make "
                         "them so, or use model.attention_impl='xla')")
    if max(config.train.length_buckets) < config.env.max_context_tokens:
        raise ValueError(f"the largest of train.length_buckets={tuple(config.train.length_buckets)}"
                         f" is below env.max_context_tokens={config.env.max_context_tokens}")
