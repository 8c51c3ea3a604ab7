"""The config every RL experiment starts from: the blocks of the design, each key read somewhere.

An experiment file (`configs/<name>.py`) calls `base_config(algo)` and changes what it needs;
`get_config("smoke")` shrinks it to a CPU run of under a minute. The dict is locked, so a
mistyped key in a file or an override (`--config.algo.clip_hgh=0.3`) fails at once, naming
the key; ml_collections also refuses a value of the wrong type (`--config.train.steps=abc`).
`check(config)` (rl_tpu/recipes/config_checks.py) adds the cross-key checks no single field
can make, before anything compiles.

`base_config` assembles one builder per block (`model_block()`, `rollout_block()`, ...); the
presets below them are the settings experiment files share (`tiny_model_warm_start`,
`largest_task`, `single_turn_reasoning`, `multi_turn_agent`), and `shrink_for_smoke` is how
every file makes its `smoke` variant, so a file states only what its experiment changes.

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

from rl_tpu.core import env as envs
from rl_tpu.recipes.algorithms import algo_config
# The checks live apart (config_checks.py); `config.check(c)` is how every launcher calls them.
from rl_tpu.recipes.config_checks import check  # noqa: F401


def base_config(algo: str = "grpo") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0
    # The driver `python -m launch.train` runs: rl_tpu/recipes/<recipe>.py's run(config, W).
    c.recipe = "rl"  # rl | sft | expert_iteration | rloop | dpo | selfplay | reward_model
    c.model = model_block()
    c.mesh = mesh_block()
    c.rollout = rollout_block()
    c.env = env_block()
    c.reward = reward_block()
    c.algo = algo_config(algo)
    c.optim = optim_block()
    c.train = train_block()
    c.schedules = schedules_block()
    c.eval = eval_block()
    c.checkpoint = checkpoint_block()
    c.log = log_block()
    c.sft = sft_block()
    c.loop = loop_block()
    c.dpo = dpo_block()
    c.selfplay = selfplay_block()
    c.reward_model = reward_model_block()
    c.lock()
    return c


def model_block() -> ml_collections.ConfigDict:
    """The policy: an HF directory (`path`), or (path = "") a tiny random model built into the
    workdir; its dtype, remat, layer scan and attention."""
    b = ml_collections.ConfigDict()
    b.path = ""
    b.tiny_arch = "qwen2"  # used when path is empty
    b.tiny_hidden = 64
    b.tiny_layers = 2
    b.tiny_vocab = 512
    b.tiny_corpus_tasks = 0  # > 0: the tiny tokenizer also learns the env's text (n tasks)
    b.tiny_init_scale = 0.04  # ~ a normal training init (std 0.02), not the demo's 0.5
    b.dtype = "float32"  # params: float32 | bfloat16 (fp32 master kept for bf16)
    b.remat = "none"  # none | full | dots
    b.scan_layers = False
    b.attention_block = 256  # causal attention's query block (0 = one), blocked_attention
    b.attention_impl = "xla"  # training's attention: xla | dot_product | splash (TPU)
    b.sampler_dtype = ""  # the embedded sampler's copy ("" = the params' dtype)
    b.lora = lora_block()
    return b


def lora_block() -> ml_collections.ConfigDict:
    """LoRA (docs/lora.md): rank > 0 trains low-rank adapters on a frozen base, in PEFT's
    definitions (alpha / rank scale, dropout on the adapter's input, kaiming-uniform A and
    zero B); only the adapters and their optimizer state train and are checkpointed."""
    b = ml_collections.ConfigDict()
    b.rank = 0  # 0: full fine-tuning
    b.alpha = 16.0  # the update is scaled by alpha / rank (alpha / sqrt(rank) with rslora)
    b.dropout = 0.0  # on the adapters' input, in training steps only
    # comma-separated projections (PEFT's target_modules), or "all" for every one of them
    b.targets = "all"
    b.init = "default"  # default (PEFT's kaiming-uniform A) | gaussian
    b.rslora = False
    # a PEFT adapter dir to start from (rank, alpha, targets and rslora above must be its own)
    b.path = ""
    # the embedded sampler: merge (W + scale A B into its own kernels, plain-model decode) or
    # lowrank (base and adapters apart; no second copy of the kernels); adapter_weights.py
    b.sampler = "merge"
    return b


def mesh_block() -> ml_collections.ConfigDict:
    """The device mesh's axes (rl_tpu/parallel.py): data, fsdp, expert and tensor parallelism."""
    b = ml_collections.ConfigDict()
    b.data = -1  # -1: every device not used by the other axes
    b.fsdp = 1
    # a mixture of experts' experts split over this many devices (it must divide the number of
    # experts); for the rest of the model another data axis
    b.expert = 1
    b.tensor = 1
    return b


def rollout_block() -> ml_collections.ConfigDict:
    """Who samples and how: the embedded JAX sampler or SGLang servers, the one temperature,
    the sampler's memory, prefix reuse, and off-policy production (staleness, partial rollouts)."""
    b = ml_collections.ConfigDict()
    b.engine = "jax"  # jax (embedded sampler) | sglang (urls below)
    b.urls = ""  # comma-separated SGLang-compatible servers, for engine=sglang
    # An sglang-router in front of those servers: generation goes through it, weight updates,
    # abort and pause still go to each of rollout.urls (docs/rollout_servers.md).
    b.router_url = ""
    b.weights_dir = ""  # where HF exports for SGLang go ("" = <workdir>/sync)
    b.temperature = 1.0  # ONE temperature: the engine samples with it, the trainer
    b.top_p = 1.0        # recomputes log-probs with it
    b.top_k = -1
    b.max_batch = 256  # embedded sampler: rows per decode batch
    # ...and at most this many KV-cache tokens (rows x (prompt + new) buckets) per sampler
    # device (0 = rows alone): long prompts then run in fewer rows at a time.
    b.kv_tokens_per_device = 0
    b.sampler_devices = 0  # embedded sampler's devices: 0 = all local, n = first n
    # ...split tensor-parallel this many ways (heads, mlp, vocab), the rest data-parallel rows;
    # 0 = the largest power of two dividing the kv heads and the devices (parallel.sampler_mesh)
    b.sampler_tensor = 0
    b.prefill_chunk = 0  # embedded sampler: prompt tokens per prefill step (0 = all)
    b.kv_dtype = ""  # embedded sampler's KV cache dtype ("" = its compute dtype)
    # ...shapes compiled before the first step, "ROWSxPROMPTxNEW,..." (e.g. "256x512x512");
    # the metric time/sampler_programs counts every shape compiled since
    b.warmup = ""
    # Embedded sampler prefix reuse (rl_tpu/rollout/prefix_cache.py): a turn prefills only what
    # its prompt adds to an earlier request's prompt + output. On by default: exact (logprobs
    # within 1e-4, greedy equal) and cheaper from turn 2 on. The cache holds at most
    # prefix_cache_tokens tokens of K/V (2 x layers x kv heads x head dim x dtype bytes each,
    # grown on demand, LRU-evicted) and is dropped on every weight update unless kept.
    b.prefix_reuse = True
    b.prefix_cache_tokens = 65536
    b.prefix_cache_keep_on_update = False  # True: reuse K/V of older weights (inexact)
    # Off-policy: 0 = on-policy (rollouts by the latest weights, synchronous); k >= 1 = an
    # asynchronous producer whose data is at most k versions old (rl_tpu/offpolicy/producer.py).
    b.max_staleness = 0
    b.deterministic = False  # async in lock-step, exactly k versions behind (exact resume)
    # Partial rollouts (async, free-running): generated tokens one rollout chunk may spend on
    # this host (0 = no limit). Generations still running then are kept and resumed under the
    # next weights, so a trajectory spans versions (each token keeps its own).
    b.partial_token_budget = 0
    # With max_staleness: train on groups older than k with their old tokens' loss masked,
    # instead of dropping the groups.
    b.mask_stale_tokens = False
    return b


def env_block() -> ml_collections.ConfigDict:
    """The environment, its kwargs, the turn and token limits, and env servers."""
    b = ml_collections.ConfigDict()
    b.name = "largest"
    b.kwargs = env_kwargs("largest")  # set_env switches name and kwargs together
    b.dataset_dir = ""  # tasks from a dataset made by launch.make_dataset ("" = the env's)
    b.train_split = "train"
    b.eval_split = "eval"
    b.max_turns = 1
    b.max_new_tokens = 16  # per turn (the generation budget L)
    b.max_context_tokens = 512
    b.step_timeout_s = 60.0
    # training steps in a row whose every episode ends in an env error before the run stops
    # (a missing package, a dead env server); 0 = never (rl_tpu/agent/env_failures.py)
    b.max_failed_steps = 3
    b.step_latency_s = 0.0  # waiting added to every env step (an env server's round trip)
    # Env servers (docs/env_servers.md): episodes play on AgentGym's servers or launch.serve_env
    # at these comma-separated URLs, round robin; "" = in this process.
    b.remote_url = ""
    b.remote_timeout_s = 30.0  # one HTTP request's limit (<= env.step_timeout_s)
    b.remote_retries = 3  # extra tries on a connection error, backoff doubling each time
    b.remote_backoff_s = 0.5  # wait before the first retry
    b.reward_reduce = "sum"
    return b


def reward_block() -> ml_collections.ConfigDict:
    """Learned rewards beside the env's (rl_tpu/rewards/, docs/rewards.md): a trajectory's
    reward = rule_weight * the env's + model_weight * model_transform(the model's score)
    + judge_weight * the judge's verdict."""
    b = ml_collections.ConfigDict()
    b.model_path = ""  # an HF *ForSequenceClassification dir ("" = the env's reward alone)
    # or reward servers (launch.serve_reward) scoring for it: "http://host:port[,...]"
    b.urls = ""
    b.model_weight = 1.0
    b.rule_weight = 0.0  # the env's own reward, when a model scores too
    b.model_transform = "none"  # none (the raw score) | sigmoid (in (0, 1))
    b.tokens_per_batch = 16384  # the scorer's rows x padded length a batch
    # A judge's verdicts (rl_tpu/rewards/judge_reward.py): "pointwise" puts the task and the
    # final reply to a judge, whose [[YES]] / [[NO]] pays 1 / 0; "pairwise" compares a task's
    # samples around a ring and pays each its win rate (no verdict: kept out of the loss);
    # the judge is an HF causal LM or ("" path) the policy itself
    b.judge = ""  # "" (none) | pointwise | pairwise
    b.judge_weight = 1.0
    b.judge_model_path = ""
    b.judge_max_new_tokens = 32
    return b


def optim_block() -> ml_collections.ConfigDict:
    """The policy's optimizer (AdamW), its schedule and gradient clipping."""
    b = ml_collections.ConfigDict()
    b.lr = 1e-6
    b.schedule = "constant"
    b.warmup_steps = 0
    b.weight_decay = 0.0
    b.grad_clip = 1.0
    return b


def train_block() -> ml_collections.ConfigDict:
    """An RL step's batch (tasks x samples), its epochs and (micro-)batches, length buckets, and
    sample replay."""
    b = ml_collections.ConfigDict()
    b.steps = 100
    b.tasks_per_step = 32  # global, all hosts
    b.samples_per_task = 8  # G
    b.epochs = 1
    b.minibatches = 1
    b.micro_batches = 1
    # The score pass (proximal and reference log-probs) over the whole batch, in this many
    # micro-batches; 0 = minibatches x micro_batches, the update's own micro-batch size.
    b.score_micro_batches = 0
    # Or a budget (> 0): each length bucket gets the fewest micro-batches whose rows x tokens
    # on one device fit it, replacing the counts above (update; score, 0 = the update's).
    b.tokens_per_device = 0
    b.score_tokens_per_device = 0
    b.length_buckets = (128, 256, 512, 1024, 2048)
    b.logprob_chunk = 128
    # Sample replay (rl_tpu/offpolicy/replay.py): past groups mixed into each update.
    b.replay = ml_collections.ConfigDict()
    b.replay.capacity = 0  # groups kept per host (0 = off)
    b.replay.fraction = 0.5  # replayed share of an update's groups
    b.replay.max_staleness = 4  # versions; older groups leave the buffer
    return b


def schedules_block() -> ml_collections.ConfigDict:
    """Schedules over RL steps: ScalingInter-RL's horizon and SIRI's generation budget."""
    b = ml_collections.ConfigDict()
    b.horizon_turns = ()  # ScalingInter-RL: H = turns[min(step // every, len - 1)]
    b.horizon_every = 100
    # SIRI (rl_tpu/schedules.py, docs/siri.md): the per-turn generation budget oscillates
    # between budget_min (compression) and env.max_new_tokens (expansion; also the eval
    # budget and Dr.GRPO's static normaliser) with a period of budget_period RL steps.
    b.budget = ""  # "" = off (env.max_new_tokens) | stair | cosine | stair_cosine
    b.budget_min = 0  # L_min, tokens a turn; >= 1 when a schedule is on
    b.budget_period = 100  # P, RL steps a compression + expansion cycle
    b.budget_start = "long"  # the cycle starts at the long budget, or "short"
    b.budget_stairs = 4  # stair_cosine: flat stairs a period, following the cosine
    return b


def eval_block() -> ml_collections.ConfigDict:
    """The held-out greedy eval: how often, on how many tasks, pass@k, its turn and token limits."""
    b = ml_collections.ConfigDict()
    b.every = 10  # RL steps; eval also runs at step 0 and after the last step
    b.num_tasks = 100
    b.pass_k = 0  # > 0: also sample k replies a task at the rollout temperature (pass@k)
    b.max_turns = 0  # the eval turn limit (0 = the training horizon of that step)
    # the eval's tokens a turn (0 = env.max_new_tokens: fixed, whatever the budget schedule)
    b.max_new_tokens = 0
    # write every eval's replies (greedy and sampled) as JSON lines beside its metrics:
    # W/evals/eval_step<k>.replies.jsonl (launch.eval of an HF dir: eval_<dir name>.replies.jsonl)
    b.save_replies = False
    return b


def checkpoint_block() -> ml_collections.ConfigDict:
    """Orbax checkpoints (rl_tpu/persistence/checkpoint.py) and the final HF export."""
    b = ml_collections.ConfigDict()
    b.every = 10
    b.keep = 3
    b.async_save = True
    b.export_hf = True  # the final policy as an HF directory, <workdir>/final_hf
    return b


def log_block() -> ml_collections.ConfigDict:
    """Metric writers: TensorBoard, curves.png, W&B, the progress line."""
    b = ml_collections.ConfigDict()
    b.tensorboard = True
    b.plot = True
    # a Weights & Biases project: the same scalars go to a W&B run named after the workdir
    # ("" = off; needs `pip install 'rl_tpu[wandb]'`)
    b.wandb_project = ""
    # stdout not a terminal (a log file): a progress line at most every `every_s` seconds,
    # the first and the last step always
    b.every_s = 5.0
    return b


def sft_block() -> ml_collections.ConfigDict:
    """SFT warm start before RL (steps = 0: none). Demonstrations come from the env's teacher
    (`teacher_skill`) or from a JSONL of chats (`data_path`)."""
    b = ml_collections.ConfigDict()
    b.steps = 0
    b.batch_size = 64
    b.lr = 1e-3
    b.warmup_steps = 0
    b.num_demos = 2000
    b.teacher_skill = 0.3
    b.data_path = ""
    b.max_length = 512
    # > 0: batches of like-length demos, sorted within pools of this many batches (for
    # multi-turn demos, whose lengths vary several-fold); 0: plain shuffled batches
    b.group_by_length = 0
    return b


def loop_block() -> ml_collections.ConfigDict:
    """Loops around the update (docs/loops.md): rounds of sample -> filter -> fine-tune.
    expert_iteration samples loop.samples_per_task replies to each of loop.tasks_per_round
    tasks from the current policy; rloop keeps the successes of a train.steps-step RL phase."""
    b = ml_collections.ConfigDict()
    b.rounds = 3
    b.tasks_per_round = 256
    b.samples_per_task = 4
    b.reward_threshold = 1.0  # a sample is kept when its reward is >= this
    b.max_per_task = 0  # distinct kept samples a task (0 = all)
    b.max_examples = 0  # kept samples a round, hardest tasks first (0 = all)
    b.sft_steps = 100  # fine-tune steps a round
    b.sft_lr = 1e-3
    b.sft_batch_size = 64
    # rloop: fine-tune the RL phase's starting weights (RLoop) or its final ones ("end": RL
    # and SFT alternating with a period of train.steps)
    b.rft_from = "start"
    return b


def dpo_block() -> ml_collections.ConfigDict:
    """Preference optimisation (rl_tpu/recipes/dpo.py): offline from dpo.data_path, else online
    for loop.rounds rounds of loop.samples_per_task replies to loop.tasks_per_round prompts."""
    b = ml_collections.ConfigDict()
    b.loss = "dpo"  # dpo | ipo | inpo
    b.beta = 0.1  # dpo / ipo; inpo's eta is 1 / beta
    b.inpo_tau = 0.1  # inpo: KL strength toward the initial policy (eta * tau <= 1)
    b.data_path = ""  # JSONL of {"prompt", "chosen", "rejected"}; "" = online pairs
    b.steps = 50  # preference steps a round (offline: in all)...
    b.epochs = 0.0  # ...or (> 0) this many passes over the round's pairs
    b.lr = 1e-4
    b.batch_size = 32  # pairs a step
    return b


def selfplay_block() -> ml_collections.ConfigDict:
    """Two-role self-play (rl_tpu/recipes/selfplay.py): train.samples_per_task proposals a
    slot, this many solver attempts a valid proposal; the proposer's reward, a function of the
    solver's success on its problem (proposer_reward)."""
    b = ml_collections.ConfigDict()
    b.solver_samples = 4
    b.proposer_reward = "peak"  # peak | learnability | band (recipes/selfplay.py)
    b.target_success = 0.5  # "peak": where the reward is 1
    b.band_low, b.band_high = 0.2, 0.8  # "band": the solver success rates paid 1
    return b


def reward_model_block() -> ml_collections.ConfigDict:
    """Reward-model training (rl_tpu/recipes/reward_model.py, docs/rewards.md): Bradley-Terry
    on preference pairs from a JSONL or from the env's ranking of the initial policy's
    loop.samples_per_task replies a task, then SSRM rounds on a pool of unlabelled pairs."""
    b = ml_collections.ConfigDict()
    b.data_path = ""  # JSONL of {"prompt", "chosen", "rejected"[, "margin", "split"]}
    b.eval_fraction = 0.1  # held-out share of a JSONL's lines that name no split
    b.prompts = 512  # "" data path: training tasks whose replies make the labelled pairs
    b.eval_prompts = 128  # ...and eval-split tasks whose replies make the held-out pairs
    b.steps = 200  # BT steps a round...
    b.epochs = 0.0  # ...or (> 0) this many passes over the round's pairs
    b.batch_size = 32  # pairs a step
    b.lr = 1e-5
    b.centring = 0.0  # coefficient of (r_chosen + r_rejected)^2: rewards stay near zero mean
    b.calibration_bins = 10
    b.ssrm_rounds = 0  # semi-supervised rounds after the first
    b.ssrm_pool = 512  # tasks whose replies make a round's unlabelled pairs
    b.ssrm_threshold = 0.9  # keep a pseudo-label when sigmoid(|r_a - r_b|) >= this
    return b


# --- Presets: the settings experiment files share, each applied to a base config -------------

def tiny_model_warm_start(c: ml_collections.ConfigDict, *, context_tokens: int, sft_steps: int,
                          num_demos: int, teacher_skill: float, sft_batch_size: int = 64,
                          corpus_tasks: int = 0) -> ml_collections.ConfigDict:
    """A tiny random model a CPU trains in minutes: 2 layers, 64 wide, float32, its tokenizer
    also learning `corpus_tasks` of the env's texts; an SFT warm start of `sft_steps` on
    `num_demos` demonstrations of the env's teacher (right `teacher_skill` of the time); the
    learning rates it learns at (RL 5e-4, SFT 3e-3); rows of at most `context_tokens` tokens.
    Call it after `set_env` (the teacher is the env's)."""
    c.model.tiny_hidden = 64
    c.model.tiny_layers = 2
    c.model.tiny_corpus_tasks = corpus_tasks
    # bf16, remat and scanned layers are for real sizes; float32 is exact and fast on a CPU
    c.model.dtype, c.model.remat, c.model.scan_layers = "float32", "none", False
    c.mesh.data, c.mesh.fsdp = -1, 1
    c.env.max_context_tokens = context_tokens
    c.train.length_buckets = ((context_tokens,) if context_tokens <= 128
                              else (context_tokens // 2, context_tokens))
    c.optim.lr = 5e-4
    c.sft.steps = sft_steps
    c.sft.batch_size = sft_batch_size
    c.sft.lr = 3e-3
    c.sft.num_demos = num_demos
    c.sft.teacher_skill = teacher_skill
    c.sft.max_length = context_tokens
    c.eval.every = 10
    c.checkpoint.every = 20
    return c


def largest_task(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The quickstart's setting, which a tiny model learns on a CPU in minutes: the `largest`
    task (name the largest of five digits, 4 new tokens), 60 steps of 32 tasks x 8 samples,
    and an SFT warm start on 4000 demonstrations of a teacher right 30% of the time.
    Experiments on it (configs/quickstart.py, bapo_offpolicy.py, the loops) change what they
    compare."""
    set_env(c, "largest")
    tiny_model_warm_start(c, context_tokens=64, sft_steps=300, num_demos=4000,
                          teacher_skill=0.3)
    c.env.max_new_tokens = 4
    c.train.steps = 60
    return c


# Sums and products of two numbers of 1 or 2 digits, no signs or brackets: the larger ones are
# more than the tiny model works out in its head, while a calculator call only copies the
# question's expression and the answer copies the tool's result.
CALCULATOR_ARITHMETIC = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2,
                         "operators": ("+", "*"), "allow_parentheses": False,
                         "allow_negation": False}


def calculator_task(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Function calling a tiny model learns on a CPU (configs/tool_calling.py, the agent
    notebook): `arithmetic` played through the `tool_calling` env with a `calculator` tool,
    calls in the tiny tokenizer's (Qwen2.5's) format; a call then an answer; an SFT warm start
    on a teacher that calls the tool half the time and guesses (wrongly) otherwise."""
    set_env(c, "tool_calling", task_env="arithmetic", tools="calculator", call_format="hermes",
            task_kwargs={"config": dict(CALCULATOR_ARITHMETIC), "isolate": False,
                         "system_prompt": "Give the final answer inside <answer>...</answer>."})
    # the tokenizer learns the env's texts (the tool schema too): a row fits 320 tokens (the
    # prompt is about 200 of them, the two replies and the tool's result the rest)
    tiny_model_warm_start(c, context_tokens=320, sft_steps=400, sft_batch_size=32,
                          num_demos=4000, teacher_skill=0.5, corpus_tasks=500)
    # 128 wide, not 64: copying the digits of a call and of its result across a 200-token
    # prompt is what this task asks, and at 64 wide the warm start miscopied every one
    c.model.tiny_hidden = 128
    c.env.max_turns = 2  # a call, then the answer
    c.env.max_new_tokens = 56  # per turn: the call is the longer reply (about 45 tokens)
    c.train.steps = 60
    c.train.tasks_per_step = 16
    c.eval.num_tasks = 200
    return c


def single_turn_reasoning(c: ml_collections.ConfigDict, env: str, *, max_new_tokens: int,
                          max_context_tokens: int) -> ml_collections.ConfigDict:
    """The settings the single-turn reasoning experiments share (one reply a task, scored by
    the env's checker): 200 steps of 64 tasks x 8 samples in 4 minibatches at lr 1e-6, bf16
    with dot remat, length buckets up to the power of two that holds the context, an eval of
    200 tasks every 20 steps."""
    set_env(c, env)
    c.env.max_new_tokens = max_new_tokens
    c.env.max_context_tokens = max_context_tokens
    top = 1 << (max_context_tokens - 1).bit_length()
    c.train.length_buckets = (top // 4, top // 2, top)
    c.train.steps = 200
    c.train.tasks_per_step = 64
    c.train.minibatches = 4
    c.optim.lr = 1e-6
    c.model.dtype = "bfloat16"
    c.model.remat = "dots"
    c.eval.every = 20
    c.eval.num_tasks = 200
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


def shrink_for_smoke(c: ml_collections.ConfigDict, *, warm_start_steps: int = 0,
                     context_tokens: int = 0, eval_tasks: int = 2) -> ml_collections.ConfigDict:
    """The `smoke` variant of any experiment: the same code path on a tiny random model, in
    30-90 s on a 2-core CPU (mostly compiling). 2 RL steps of 2 tasks x 2 samples, at most 8
    tokens and 2 turns a turn limit, an eval of `eval_tasks` every 2 steps, a checkpoint every
    step; loops around the update run 2 short rounds. `warm_start_steps` > 0 keeps a short SFT
    warm start (a loop's filters and pairs then have samples that differ in reward);
    `context_tokens` > 0 sets the context limit, SFT's and two length buckets to fit it (a
    multi-turn smoke's two turns). An experiment file changes what its smoke needs beyond."""
    c.model.path = ""
    c.model.sampler_dtype = ""
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = -1, 1, 1
    c.train.steps = 2
    c.train.tasks_per_step = 2
    c.train.samples_per_task = 2
    c.train.epochs = 1
    c.train.minibatches = 1
    c.train.micro_batches = 1
    c.env.max_new_tokens = min(c.env.max_new_tokens, 8)
    c.env.max_turns = min(c.env.max_turns, 2)
    c.eval.max_turns = min(c.eval.max_turns, 2)
    c.schedules.horizon_turns = tuple(min(t, 2) for t in c.schedules.horizon_turns)
    c.schedules.horizon_every = 1
    if context_tokens:
        c.env.max_context_tokens = context_tokens
        c.train.length_buckets = (context_tokens // 2, context_tokens)
        c.sft.max_length = context_tokens
    c.eval.every = 2
    c.eval.num_tasks = eval_tasks
    c.eval.pass_k = min(c.eval.pass_k, 2)
    c.checkpoint.every = 1
    c.log.plot = False
    c.loop.rounds = 2
    c.loop.tasks_per_round = 8
    c.loop.samples_per_task = 4
    c.loop.sft_steps = 3
    c.loop.sft_batch_size = 8
    c.sft.steps = warm_start_steps
    if warm_start_steps:
        c.sft.num_demos = 256
        c.sft.batch_size = 16
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
