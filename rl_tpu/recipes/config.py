"""The config every RL experiment starts from: the blocks of the design, each key read somewhere.

An experiment file (`configs/<name>.py`) calls `base_config(algo)` and changes what it needs;
`get_config("smoke")` shrinks it to a CPU run of under a minute. The dict is locked, so a
mistyped key in a file or an override (`--config.algo.clip_hgh=0.3`) fails at once, naming
the key; ml_collections also refuses a value of the wrong type (`--config.train.steps=abc`).
`check(config)` adds the cross-key checks no single field can make, before anything compiles.

Two keys pick the defaults of a whole block, so changing them means rebuilding that block:
`algo.name` (the `algo` block is `algo_config(name)`: `set_algo`) and `env.name` (`env.kwargs`
holds that env's keyword arguments with their defaults, each a typed key an override can set:
`set_env`). The launchers do both when the command line changes a name, then re-apply the
command line's other overrides of the block. A script that assigns `algo.name` alone keeps
the old algorithm's defaults; `check` cannot tell which keys a user set on purpose, so it
refuses only the unambiguous case, a block that still holds exactly another algorithm's
defaults (advantage, loss and every other name-dependent key) under the new name.
"""

from __future__ import annotations

import collections.abc
import inspect
import typing
from typing import Any, Mapping, Optional

import ml_collections
from ml_collections import config_dict

from rl_tpu import schedules

from rl_tpu.agent import branching
from rl_tpu.envs import base as envs
from rl_tpu.models.fused_attention import SPLASH_BLOCK
from rl_tpu.recipes.algorithms import ALGORITHMS, algo_config, estimator_use, loss_config


def base_config(algo: str = "grpo") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0
    # The driver `python -m launch.train` runs: rl_tpu/recipes/<recipe>.py's run(config, W).
    c.recipe = "rl"  # rl | sft | expert_iteration | rloop | dpo | selfplay

    # model: an HF directory, or (path = "") a tiny random model built into the workdir.
    c.model = ml_collections.ConfigDict()
    c.model.path = ""
    c.model.tiny_arch = "qwen2"  # used when path is empty
    c.model.tiny_hidden = 64
    c.model.tiny_layers = 2
    c.model.tiny_vocab = 512
    c.model.tiny_corpus_tasks = 0  # > 0: the tiny tokenizer also learns the env's text (n tasks)
    c.model.tiny_init_scale = 0.04  # ~ a normal training init (std 0.02), not the demo's 0.5
    c.model.dtype = "float32"  # params: float32 | bfloat16 (fp32 master kept for bf16)
    c.model.remat = "none"  # none | full | dots
    c.model.scan_layers = False
    c.model.attention_block = 256  # causal attention's query block (0 = one), blocked_attention
    c.model.attention_impl = "xla"  # training's attention: xla | dot_product | splash (TPU)
    c.model.sampler_dtype = ""  # the embedded sampler's copy ("" = the params' dtype)

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = -1  # -1: every device not used by the other axes
    c.mesh.fsdp = 1
    c.mesh.tensor = 1

    c.rollout = ml_collections.ConfigDict()
    c.rollout.engine = "jax"  # jax (embedded sampler) | sglang (urls below)
    c.rollout.urls = ""  # comma-separated SGLang-compatible servers, for engine=sglang
    # An sglang-router in front of those servers: generation goes through it, weight updates,
    # abort and pause still go to each of rollout.urls (docs/rollout_servers.md).
    c.rollout.router_url = ""
    c.rollout.weights_dir = ""  # where HF exports for SGLang go ("" = <workdir>/sync)
    c.rollout.temperature = 1.0  # ONE temperature: the engine samples with it, the trainer
    c.rollout.top_p = 1.0        # recomputes log-probs with it
    c.rollout.top_k = -1
    c.rollout.max_batch = 256  # embedded sampler: rows per decode batch
    # ...and at most this many KV-cache tokens (rows x (prompt + new) buckets) per sampler
    # device (0 = rows alone): long prompts then run in fewer rows at a time.
    c.rollout.kv_tokens_per_device = 0
    c.rollout.sampler_devices = 0  # embedded sampler's devices: 0 = all local, n = first n
    # ...split tensor-parallel this many ways (heads, mlp, vocab), the rest data-parallel rows;
    # 0 = the largest power of two dividing the kv heads and the devices (parallel.sampler_mesh)
    c.rollout.sampler_tensor = 0
    c.rollout.prefill_chunk = 0  # embedded sampler: prompt tokens per prefill step (0 = all)
    c.rollout.kv_dtype = ""  # embedded sampler's KV cache dtype ("" = its compute dtype)
    # ...shapes compiled before the first step, "ROWSxPROMPTxNEW,..." (e.g. "256x512x512");
    # the metric time/sampler_programs counts every shape compiled since
    c.rollout.warmup = ""
    # Embedded sampler prefix reuse (rl_tpu/rollout/prefix_cache.py): a turn prefills only what
    # its prompt adds to an earlier request's prompt + output. On by default: exact (logprobs
    # within 1e-4, greedy equal) and cheaper from turn 2 on. The cache holds at most
    # prefix_cache_tokens tokens of K/V (2 x layers x kv heads x head dim x dtype bytes each,
    # grown on demand, LRU-evicted) and is dropped on every weight update unless kept.
    c.rollout.prefix_reuse = True
    c.rollout.prefix_cache_tokens = 65536
    c.rollout.prefix_cache_keep_on_update = False  # True: reuse K/V of older weights (inexact)
    # Off-policy: 0 = on-policy (rollouts by the latest weights, synchronous); k >= 1 = an
    # asynchronous producer whose data is at most k versions old (rl_tpu/offpolicy/producer.py).
    c.rollout.max_staleness = 0
    c.rollout.deterministic = False  # async in lock-step, exactly k versions behind (exact resume)
    # Partial rollouts (async, free-running): generated tokens one rollout chunk may spend on
    # this host (0 = no limit). Generations still running then are kept and resumed under the
    # next weights, so a trajectory spans versions (each token keeps its own).
    c.rollout.partial_token_budget = 0
    # With max_staleness: train on groups older than k with their old tokens' loss masked,
    # instead of dropping the groups.
    c.rollout.mask_stale_tokens = False

    c.env = ml_collections.ConfigDict()
    c.env.name = "largest"
    c.env.kwargs = env_kwargs("largest")  # set_env switches name and kwargs together
    c.env.dataset_dir = ""  # tasks from a dataset made by launch.make_dataset ("" = the env's)
    c.env.train_split = "train"
    c.env.eval_split = "eval"
    c.env.max_turns = 1
    c.env.max_new_tokens = 16  # per turn (the generation budget L)
    c.env.max_context_tokens = 512
    c.env.step_timeout_s = 60.0
    c.env.step_latency_s = 0.0  # waiting added to every env step (an env server's round trip)
    # Env servers (docs/env_servers.md): episodes play on AgentGym's servers or launch.serve_env
    # at these comma-separated URLs, round robin; "" = in this process.
    c.env.remote_url = ""
    c.env.remote_timeout_s = 30.0  # one HTTP request's limit (<= env.step_timeout_s)
    c.env.remote_retries = 3  # extra tries on a connection error, backoff doubling each time
    c.env.remote_backoff_s = 0.5  # wait before the first retry
    c.env.reward_reduce = "sum"

    c.algo = algo_config(algo)

    c.optim = ml_collections.ConfigDict()
    c.optim.lr = 1e-6
    c.optim.schedule = "constant"
    c.optim.warmup_steps = 0
    c.optim.weight_decay = 0.0
    c.optim.grad_clip = 1.0

    c.train = ml_collections.ConfigDict()
    c.train.steps = 100
    c.train.tasks_per_step = 32  # global, all hosts
    c.train.samples_per_task = 8  # G
    c.train.epochs = 1
    c.train.minibatches = 1
    c.train.micro_batches = 1
    # The score pass (proximal and reference log-probs) over the whole batch, in this many
    # micro-batches; 0 = minibatches x micro_batches, the update's own micro-batch size.
    c.train.score_micro_batches = 0
    # Or a budget (> 0): each length bucket gets the fewest micro-batches whose rows x tokens
    # on one device fit it, replacing the counts above (update; score, 0 = the update's).
    c.train.tokens_per_device = 0
    c.train.score_tokens_per_device = 0
    c.train.length_buckets = (128, 256, 512, 1024, 2048)
    c.train.logprob_chunk = 128
    # Sample replay (rl_tpu/offpolicy/replay.py): past groups mixed into each update.
    c.train.replay = ml_collections.ConfigDict()
    c.train.replay.capacity = 0  # groups kept per host (0 = off)
    c.train.replay.fraction = 0.5  # replayed share of an update's groups
    c.train.replay.max_staleness = 4  # versions; older groups leave the buffer

    c.schedules = ml_collections.ConfigDict()
    c.schedules.horizon_turns = ()  # ScalingInter-RL: H = turns[min(step // every, len - 1)]
    c.schedules.horizon_every = 100
    # SIRI (rl_tpu/schedules.py, docs/siri.md): the per-turn generation budget oscillates
    # between budget_min (compression) and env.max_new_tokens (expansion; also the eval
    # budget and Dr.GRPO's static normaliser) with a period of budget_period RL steps.
    c.schedules.budget = ""  # "" = off (env.max_new_tokens) | stair | cosine | stair_cosine
    c.schedules.budget_min = 0  # L_min, tokens a turn; >= 1 when a schedule is on
    c.schedules.budget_period = 100  # P, RL steps a compression + expansion cycle
    c.schedules.budget_start = "long"  # the cycle starts at the long budget, or "short"
    c.schedules.budget_stairs = 4  # stair_cosine: flat stairs a period, following the cosine

    c.eval = ml_collections.ConfigDict()
    c.eval.every = 10  # RL steps; eval also runs at step 0 and after the last step
    c.eval.num_tasks = 100
    c.eval.pass_k = 0  # > 0: also sample k replies a task at the rollout temperature (pass@k)
    c.eval.max_turns = 0  # the eval turn limit (0 = the training horizon of that step)
    # the eval's tokens a turn (0 = env.max_new_tokens: fixed, whatever the budget schedule)
    c.eval.max_new_tokens = 0

    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every = 10
    c.checkpoint.keep = 3
    c.checkpoint.async_save = True
    c.checkpoint.export_hf = True  # the final policy as an HF directory, <workdir>/final_hf

    c.log = ml_collections.ConfigDict()
    c.log.tensorboard = True
    c.log.plot = True
    # a Weights & Biases project: the same scalars go to a W&B run named after the workdir
    # ("" = off; needs `pip install 'rl_tpu[wandb]'`)
    c.log.wandb_project = ""
    # stdout not a terminal (a log file): a progress line at most every `every_s` seconds,
    # the first and the last step always
    c.log.every_s = 5.0

    # SFT warm start before RL (steps = 0: none). Demonstrations come from the env's teacher
    # (`teacher_skill`) or from a JSONL of chats (`data_path`).
    c.sft = ml_collections.ConfigDict()
    c.sft.steps = 0
    c.sft.batch_size = 64
    c.sft.lr = 1e-3
    c.sft.warmup_steps = 0
    c.sft.num_demos = 2000
    c.sft.teacher_skill = 0.3
    c.sft.data_path = ""
    c.sft.max_length = 512
    # > 0: batches of like-length demos, sorted within pools of this many batches (for
    # multi-turn demos, whose lengths vary several-fold); 0: plain shuffled batches
    c.sft.group_by_length = 0

    # Loops around the update (docs/loops.md): rounds of sample -> filter -> fine-tune.
    # expert_iteration samples loop.samples_per_task replies to each of loop.tasks_per_round
    # tasks from the current policy; rloop keeps the successes of a train.steps-step RL phase.
    c.loop = ml_collections.ConfigDict()
    c.loop.rounds = 3
    c.loop.tasks_per_round = 256
    c.loop.samples_per_task = 4
    c.loop.reward_threshold = 1.0  # a sample is kept when its reward is >= this
    c.loop.max_per_task = 0  # distinct kept samples a task (0 = all)
    c.loop.max_examples = 0  # kept samples a round, hardest tasks first (0 = all)
    c.loop.sft_steps = 100  # fine-tune steps a round
    c.loop.sft_lr = 1e-3
    c.loop.sft_batch_size = 64
    # rloop: fine-tune the RL phase's starting weights (RLoop) or its final ones ("end": RL
    # and SFT alternating with a period of train.steps)
    c.loop.rft_from = "start"

    # Preference optimisation (rl_tpu/recipes/dpo.py): offline from dpo.data_path, else online
    # for loop.rounds rounds of loop.samples_per_task replies to loop.tasks_per_round prompts.
    c.dpo = ml_collections.ConfigDict()
    c.dpo.loss = "dpo"  # dpo | ipo | inpo
    c.dpo.beta = 0.1  # dpo / ipo; inpo's eta is 1 / beta
    c.dpo.inpo_tau = 0.1  # inpo: KL strength toward the initial policy (eta * tau <= 1)
    c.dpo.data_path = ""  # JSONL of {"prompt", "chosen", "rejected"}; "" = online pairs
    c.dpo.steps = 50  # preference steps a round (offline: in all)...
    c.dpo.epochs = 0.0  # ...or (> 0) this many passes over the round's pairs
    c.dpo.lr = 1e-4
    c.dpo.batch_size = 32  # pairs a step

    # Two-role self-play (rl_tpu/recipes/selfplay.py): train.samples_per_task proposals a
    # slot, this many solver attempts a valid proposal; the proposer's reward peaks when the
    # solver's success on its problem is target_success.
    c.selfplay = ml_collections.ConfigDict()
    c.selfplay.solver_samples = 4
    c.selfplay.target_success = 0.5
    c.lock()
    return c


def largest_task(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The quickstart's setting, which a tiny model learns on a CPU in minutes: the `largest`
    task (name the largest of five digits, 4 new tokens), a 2-layer 64-wide model, 32 tasks x
    8 samples a step at lr 5e-4, and an SFT warm start on 4000 demonstrations of a teacher
    right 30% of the time. Experiments on it (configs/quickstart.py, bapo_offpolicy.py)
    change what they compare."""
    c.model.tiny_hidden = 64
    c.model.tiny_layers = 2
    set_env(c, "largest")
    c.env.max_turns = 1
    c.env.max_new_tokens = 4
    c.env.max_context_tokens = 64
    c.train.length_buckets = (64,)
    c.train.steps = 60
    c.train.tasks_per_step = 32
    c.train.samples_per_task = 8
    c.optim.lr = 5e-4
    c.optim.grad_clip = 1.0
    c.sft.steps = 300
    c.sft.batch_size = 64
    c.sft.lr = 3e-3
    c.sft.num_demos = 4000
    c.sft.teacher_skill = 0.3
    c.sft.max_length = 64
    c.eval.every = 10
    c.checkpoint.every = 20
    return c


def multi_turn_agent(c: ml_collections.ConfigDict, env: str, *, turns: int,
                     horizon_stages: tuple = (), max_new_tokens: int = 128,
                     max_context_tokens: int = 8192) -> ml_collections.ConfigDict:
    """The settings every multi-turn agent experiment shares (AgentGym-RL's scale: 32 tasks x 8
    samples a step, 4 minibatches, lr 1e-6, bf16 with remat, 300 steps, horizon stages every
    100 steps); an experiment file sets the env and changes what differs."""
    set_env(c, env)
    c.env.max_turns = turns
    c.env.max_new_tokens = max_new_tokens
    c.env.max_context_tokens = max_context_tokens
    c.train.length_buckets = tuple(b for b in (1024, 2048, 4096, 8192, 12288, 16384)
                                   if b < max_context_tokens) + (max_context_tokens,)
    c.schedules.horizon_turns = tuple(horizon_stages)
    c.schedules.horizon_every = 100
    c.train.steps = 300
    c.train.tasks_per_step = 32
    c.train.samples_per_task = 8
    c.train.minibatches = 4
    c.optim.lr = 1e-6
    # Real sizes (launch.compile_check, docs/scaling.md): params and optimizer state sharded
    # over every chip, scanned layers (one layer's program, whatever the depth) and full remat.
    # Qwen2.5-7B's update at 8192 tokens then needs 9.6 GiB of a v5p chip's 95 with splash
    # attention (remat "dots": 37.8 GiB; replicated params: 139 GiB).
    c.mesh.data, c.mesh.fsdp = 1, -1
    c.model.dtype = "bfloat16"
    c.model.scan_layers = True
    c.model.remat = "full"
    # Splash attention (a Pallas kernel) on TPU, the blocked einsum elsewhere: Qwen2.5-1.5B's
    # score pass on a v5e-16 needs 1.4 GiB a chip with it, 8.1 without (docs/scaling.md).
    c.model.attention_impl = "splash"
    # Micro-batches and sampler rows from token budgets, so a short early bucket runs whole
    # and the 8192-token one a row a chip (Qwen2.5-1.5B on a v5e-16: at most 4.9 GiB of 16).
    c.train.tokens_per_device = 8192
    c.train.score_tokens_per_device = 16384
    c.rollout.kv_tokens_per_device = 32768
    c.rollout.prefill_chunk = 2048  # a long turn's prefill holds 2048 tokens' activations
    c.eval.every = 25
    c.eval.num_tasks = 100
    return c


def shrink_for_smoke(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The `smoke` variant of any experiment: a tiny random model, 2 steps of 2 tasks x 2
    samples, short turns; the same code path, on a 2-core CPU in 30-90 s (mostly compiling)."""
    c.model.path = ""
    c.model.sampler_dtype = ""
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = -1, 1, 1
    c.train.steps = 2
    c.train.tasks_per_step = 2
    c.train.samples_per_task = 2
    c.train.epochs = 1
    c.train.minibatches = 1
    c.train.micro_batches = 1
    c.env.max_new_tokens = 8
    c.env.max_turns = min(c.env.max_turns, 2)
    c.schedules.horizon_turns = tuple(min(t, 2) for t in c.schedules.horizon_turns)
    c.schedules.horizon_every = 1
    c.eval.every = 2
    c.eval.num_tasks = 2
    c.eval.pass_k = min(c.eval.pass_k, 2)
    c.checkpoint.every = 1
    c.sft.steps = 0
    c.log.plot = False
    return c


def shrink_loop_for_smoke(c: ml_collections.ConfigDict, warm_start_steps: int = 30
                         ) -> ml_collections.ConfigDict:
    """The `smoke` variant of a loop around the update (expert iteration, RLoop, DPO,
    self-play, tipping): a short warm start (whose samples already differ in reward, so the
    filters and pairs have something to keep), 2 short rounds, a tiny eval."""
    c.loop.rounds = 2
    c.loop.tasks_per_round = 8
    c.loop.samples_per_task = 4
    c.loop.sft_steps = 3
    c.loop.sft_batch_size = 8
    c.sft.steps = warm_start_steps
    c.sft.num_demos = 256
    c.sft.batch_size = 16
    c.eval.num_tasks = 8
    c.eval.every = 2
    c.checkpoint.every = 1
    c.log.plot = False
    return c


def env_kwargs(name: str) -> ml_collections.ConfigDict:
    """Env `name`'s keyword arguments with their defaults, as a locked block: each one a key of
    its type, so an override (`--config.env.kwargs.num_items=3`) is checked like any other. A
    kwarg defaulting to None, or without a default, is a typed placeholder (None = not given);
    one no config can hold (a Python object) is left out. Empty for a `**kwargs` factory."""
    block = ml_collections.ConfigDict()
    for p in (envs.kwargs_of(name) or {}).values():
        default = None if p.default is p.empty else p.default
        field_type = _field_type(p.annotation, default)
        if field_type is not None:
            block[p.name] = (config_dict.placeholder(field_type) if default is None
                             else tuple(default) if field_type is tuple else default)
    block.lock()
    return block


def _field_type(annotation, default) -> type | None:
    """The config type of a kwarg: bool/int/float/str as annotated, tuple for a sequence,
    object (any literal) for a dict or an unannotated kwarg without a typed default."""
    if annotation is inspect.Parameter.empty or isinstance(annotation, str):  # str: unresolved
        return type(default) if isinstance(default, (bool, int, float, str, tuple)) else object
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is typing.Union and len(args) == 1:  # Optional[X]
        annotation = args[0]
    origin = typing.get_origin(annotation) or annotation
    if origin in (bool, int, float, str):
        return origin
    if origin in (tuple, list, collections.abc.Sequence):
        return tuple
    if origin in (dict, collections.abc.Mapping):
        return object
    return None


def set_env(c: ml_collections.ConfigDict, name: str, **kwargs: Any) -> ml_collections.ConfigDict:
    """Sets env.name and env.kwargs together: that env's kwargs with their defaults
    (`env_kwargs`), `kwargs` on top; a kwarg the env does not take fails, listing those it does."""
    block = env_kwargs(name)
    unknown = sorted(set(kwargs) - set(block))
    if unknown:
        raise ValueError(f"env {name!r} takes no keyword argument {', '.join(unknown)} (its "
                         f"kwargs: {', '.join(block) or 'none'})")
    for key, value in kwargs.items():
        block[key] = value
    c.env.name = name
    c.env.kwargs = block
    return c


def set_algo(c: ml_collections.ConfigDict, name: str,
             overrides: Optional[Mapping[str, Any]] = None) -> ml_collections.ConfigDict:
    """Gives `c` the algo block of `name` (`algo_config(name)`: that algorithm's defaults), then
    sets `overrides` (keys under algo, e.g. {"clip_high": 0.3, "bapo.variant": "verl"}) in
    their order."""
    block = algo_config(name)
    block.lock()
    for key, value in (overrides or {}).items():
        *parents, leaf = key.split(".")
        holder = block
        for part in parents:
            holder = holder[part]
        holder[leaf] = value
    c.algo = block
    return c


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
             "sft.steps": 0}


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
    from rl_tpu.train.state import SCHEDULES
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
    from rl_tpu.rollout.http_transport import normalise_url
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
    from rl_tpu.env_serving.remote import parse_urls
    parse_urls(env.remote_url)  # each one http(s)://host[:port]
    if not 0 < env.remote_timeout_s <= env.step_timeout_s:
        raise ValueError(f"env.remote_timeout_s={env.remote_timeout_s} must be > 0 and <= "
                         f"env.step_timeout_s={env.step_timeout_s} (the limit on a whole env "
                         "call, retries included)")
    if env.remote_retries < 0 or env.remote_backoff_s < 0:
        raise ValueError(f"env.remote_retries={env.remote_retries} and env.remote_backoff_s="
                         f"{env.remote_backoff_s} must be >= 0")


RECIPES = ("rl", "sft", "expert_iteration", "rloop", "dpo", "selfplay")


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
    if config.recipe == "dpo" and not dpo.data_path and loop.samples_per_task < 2:
        raise ValueError("online DPO pairs the best and worst of a prompt's replies: set "
                         "loop.samples_per_task >= 2")


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
    if config.recipe not in RECIPES:
        raise ValueError(f"recipe={config.recipe!r}; choose one of {RECIPES}")
    _check_loop(config)
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
        from rl_tpu.rollout.http_transport import normalise_url
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
