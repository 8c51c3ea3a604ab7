"""The config every RL experiment starts from: the blocks of the design, each key read somewhere.

An experiment file (`configs/<name>.py`) calls `base_config(algo)` and changes what it needs;
`get_config("smoke")` shrinks it to a CPU run of under a minute. The dict is locked, so a
mistyped key in a file or an override (`--config.algo.clip_hgh=0.3`) fails at once, naming
the key; ml_collections also refuses a value of the wrong type (`--config.train.steps=abc`).
`check(config)` adds the cross-key checks no single field can make, before anything compiles.
"""

from __future__ import annotations

import ml_collections

from rl_tpu.recipes.algorithms import ALGORITHMS, algo_config


def base_config(algo: str = "grpo") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0

    # model: an HF directory, or (path = "") a tiny random model built into the workdir.
    c.model = ml_collections.ConfigDict()
    c.model.path = ""
    c.model.tiny_arch = "qwen2"  # used when path is empty
    c.model.tiny_hidden = 64
    c.model.tiny_layers = 2
    c.model.tiny_vocab = 512
    c.model.tiny_init_scale = 0.04  # ~ a normal training init (std 0.02), not the demo's 0.5
    c.model.dtype = "float32"  # params: float32 | bfloat16 (fp32 master kept for bf16)
    c.model.remat = "none"  # none | full | dots
    c.model.scan_layers = False
    c.model.sampler_dtype = ""  # the embedded sampler's copy ("" = the params' dtype)

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = -1  # -1: every device not used by the other axes
    c.mesh.fsdp = 1
    c.mesh.tensor = 1

    c.rollout = ml_collections.ConfigDict()
    c.rollout.engine = "jax"  # jax (embedded sampler) | sglang (urls below)
    c.rollout.urls = ""  # comma-separated SGLang-compatible servers, for engine=sglang
    c.rollout.weights_dir = ""  # where HF exports for SGLang go ("" = <workdir>/sync)
    c.rollout.temperature = 1.0  # ONE temperature: the engine samples with it, the trainer
    c.rollout.top_p = 1.0        # recomputes log-probs with it
    c.rollout.top_k = -1
    c.rollout.max_batch = 256  # embedded sampler: rows per decode batch
    c.rollout.sampler_devices = 0  # embedded sampler's devices: 0 = all local, n = first n
    c.rollout.max_staleness = 0  # 0 = on-policy (the only mode this recipe runs today)

    c.env = ml_collections.ConfigDict()
    c.env.name = "largest"
    c.env.kwargs = ml_collections.ConfigDict()
    c.env.dataset_dir = ""  # tasks from a dataset made by launch.make_dataset ("" = the env's)
    c.env.train_split = "train"
    c.env.eval_split = "eval"
    c.env.max_turns = 1
    c.env.max_new_tokens = 16  # per turn (the generation budget L)
    c.env.max_context_tokens = 512
    c.env.step_timeout_s = 60.0
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
    c.train.length_buckets = (128, 256, 512, 1024, 2048)
    c.train.logprob_chunk = 128

    c.schedules = ml_collections.ConfigDict()
    c.schedules.horizon_turns = ()  # ScalingInter-RL: H = turns[min(step // every, len - 1)]
    c.schedules.horizon_every = 100

    c.eval = ml_collections.ConfigDict()
    c.eval.every = 10  # RL steps; eval also runs at step 0 and after the last step
    c.eval.num_tasks = 100
    c.eval.pass_k = 0  # > 0: also sample k replies a task at the rollout temperature (pass@k)
    c.eval.max_turns = 0  # the eval turn limit (0 = the training horizon of that step)

    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every = 10
    c.checkpoint.keep = 3
    c.checkpoint.async_save = True
    c.checkpoint.export_hf = True  # the final policy as an HF directory, <workdir>/final_hf

    c.log = ml_collections.ConfigDict()
    c.log.tensorboard = True
    c.log.plot = True

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
    c.lock()
    return c


def multi_turn_agent(c: ml_collections.ConfigDict, env: str, *, turns: int,
                     horizon_stages: tuple = (), max_new_tokens: int = 128,
                     max_context_tokens: int = 8192) -> ml_collections.ConfigDict:
    """The settings every multi-turn agent experiment shares (AgentGym-RL's scale: 32 tasks x 8
    samples a step, 4 minibatches, lr 1e-6, bf16 with remat, 300 steps, horizon stages every
    100 steps); an experiment file sets the env and changes what differs."""
    c.env.name = env
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
    c.model.dtype = "bfloat16"
    c.model.remat = "dots"
    c.eval.every = 25
    c.eval.num_tasks = 100
    return c


def shrink_for_smoke(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The `smoke` variant of any experiment: a tiny random model, 2 steps of 2 tasks x 2
    samples, short turns; the same code path, on a CPU in well under a minute."""
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


def check(config: ml_collections.ConfigDict) -> None:
    """Cross-key checks that no single field can make; each error names the keys to change."""
    if config.algo.name not in ALGORITHMS:
        raise ValueError(f"algo.name={config.algo.name!r}; choose one of {ALGORITHMS}")
    if config.rollout.engine not in ("jax", "sglang"):
        raise ValueError(f"rollout.engine={config.rollout.engine!r}; choose 'jax' or 'sglang'")
    if config.rollout.engine == "sglang" and not config.rollout.urls:
        raise ValueError("rollout.engine='sglang' needs rollout.urls (or --rollout_urls)")
    if config.rollout.max_staleness != 0:
        raise ValueError("rollout.max_staleness > 0 (off-policy rollouts) is not supported by "
                         "this recipe yet; set it to 0")
    if config.train.samples_per_task < 1 or config.train.tasks_per_step < 1:
        raise ValueError("train.tasks_per_step and train.samples_per_task must be >= 1")
    group_based = config.algo.advantage in ("grpo", "dr_grpo", "rloo")
    if group_based and config.train.samples_per_task < 2:
        raise ValueError(f"algo.advantage={config.algo.advantage!r} compares samples of a task: "
                         "set train.samples_per_task >= 2")
    if config.env.max_new_tokens + 16 > config.env.max_context_tokens:
        raise ValueError(f"env.max_context_tokens={config.env.max_context_tokens} leaves no "
                         f"room for env.max_new_tokens={config.env.max_new_tokens} and a prompt")
    if max(config.train.length_buckets) < config.env.max_context_tokens:
        raise ValueError(f"the largest of train.length_buckets={tuple(config.train.length_buckets)}"
                         f" is below env.max_context_tokens={config.env.max_context_tokens}")
    if config.checkpoint.every < 1 or config.eval.every < 1:
        raise ValueError("checkpoint.every and eval.every must be >= 1 (steps)")
