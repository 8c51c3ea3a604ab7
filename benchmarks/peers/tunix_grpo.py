"""Tunix's side of benchmarks/peers.py: GRPO steps of the shared random Qwen2 with Tunix's own
`GRPOLearner` (its vanilla JAX sampler, actor and rollout on one mesh) on CPU JAX; prints one
JSON line (`PEER_RESULT {...}`). Runs in the Tunix venv (`python benchmarks/peers.py --install`).

    ~/.cache/rl_tpu/peers/tunix/bin/python benchmarks/peers/tunix_grpo.py \
        --model_dir /tmp/peer_model --prompts_file /tmp/peer_model/prompts.json --steps 4

The model is Tunix's Qwen2 built from the HF dir's config.json and loaded from its safetensors
(`create_model_from_safe_tensors`). One learner step = `--prompts` text prompts (of exactly the
prompt length in ids) x `--samples` generations (num_generations), num_iterations 1, one
mini-batch (one optimizer step on all the completions), beta 0 (no reference model), AdamW with
global-norm clipping 1.0. EOS is a token id past the vocabulary, so every completion runs to
`--completion` tokens. Tunix hands reward functions the completion texts: the rule reward (the
fraction of even ids) counts the ids of the text re-encoded. Timed: each global step
(`_run_global_step`, generation + update); sample = `_generate_and_compute_advantage`
(generation + rewards + advantages), update = the rest.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from importlib.metadata import version

import jax
import numpy as np
import optax
import transformers
from flax import nnx
from tunix.models.qwen2 import model as qwen2_model
from tunix.models.qwen2 import params as qwen2_params
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.grpo import grpo_learner
from tunix.rl.rollout import base_rollout

import peer_args  # (this folder: the flags every peer child shares)


def tunix_config(model_dir: str) -> qwen2_model.ModelConfig:
    """Tunix's Qwen2 config from the HF config.json (the field names differ)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        hf = json.load(f)
    theta = hf.get("rope_theta") or hf.get("rope_parameters", {}).get("rope_theta", 10000.0)
    return qwen2_model.ModelConfig(
        num_layers=hf["num_hidden_layers"], vocab_size=hf["vocab_size"],
        embed_dim=hf["hidden_size"], hidden_dim=hf["intermediate_size"],
        num_heads=hf["num_attention_heads"], head_dim=hf["head_dim"],
        num_kv_heads=hf["num_key_value_heads"], rope_theta=int(theta),
        norm_eps=hf["rms_norm_eps"], use_tied_embedding=hf["tie_word_embeddings"])


def timed_method(obj, name: str) -> list[float]:
    """Replaces obj.name with a wrapper that records each call's wall time in the list returned."""
    times, inner = [], getattr(obj, name)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        out = inner(*args, **kwargs)
        times.append(time.perf_counter() - start)
        return out

    setattr(obj, name, timed)
    return times


def main():
    args = peer_args.parser(__doc__, "JSON of the prompt texts per step (benchmarks/peers.py "
                            "writes it)").parse_args()
    per_step = peer_args.prompt_steps(args)
    # one array per batch: Tunix repeats each leaf of a batch G times (a list of strings would
    # be G-fold copies of every string)
    batches = [{"prompts": np.array([p["text"] for p in step])}
               for step in per_step]
    prompt_len = len(per_step[0][0]["ids"])

    t = time.perf_counter()
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model_dir)
    cfg = tunix_config(args.model_dir)
    # Auto axes: Tunix's models shard with logical rules (jax.make_mesh's default is Explicit)
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), devices=jax.devices()[:1],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    model = qwen2_params.create_model_from_safe_tensors(args.model_dir, cfg, mesh)

    def even_fraction(prompts, completions, **_) -> list[float]:
        """The rule reward every side uses: the share of even ids in a completion."""
        ids = [tokenizer(c, add_special_tokens=False)["input_ids"] for c in completions]
        return [sum(1 for t in x if t % 2 == 0) / max(len(x), 1) for x in ids]

    cluster_config = rl_cluster_lib.ClusterConfig(
        role_to_mesh={rl_cluster_lib.Role.ACTOR: mesh, rl_cluster_lib.Role.REFERENCE: mesh,
                      rl_cluster_lib.Role.ROLLOUT: mesh},
        rollout_engine="vanilla", offload_to_cpu=False,
        training_config=rl_cluster_lib.RLTrainingConfig(
            actor_optimizer=optax.chain(optax.clip_by_global_norm(1.0),
                                        optax.adamw(args.lr, weight_decay=0.0)),
            eval_every_n_steps=10 ** 9, max_steps=args.steps + 1),
        rollout_config=base_rollout.RolloutConfig(
            max_tokens_to_generate=args.completion, max_prompt_length=prompt_len,
            kv_cache_size=prompt_len + args.completion, temperature=1.0, top_p=1.0,
            # an id no sample can be: completions always run to max_tokens_to_generate
            eos_tokens=[cfg.vocab_size]))
    cluster = rl_cluster_lib.RLCluster(actor=model, tokenizer=tokenizer,
                                       cluster_config=cluster_config)
    learner = grpo_learner.GRPOLearner(
        rl_cluster=cluster, reward_fns=even_fraction,
        algo_config=grpo_learner.GRPOConfig(num_generations=args.samples, num_iterations=1,
                                            beta=0.0))
    step_times = timed_method(learner, "_run_global_step")
    sample_times = timed_method(learner, "_generate_and_compute_advantage")
    # Tokens sampled per completion, to check each ran to full length. (Counted from the
    # rollout: Tunix's completion mask also drops a sampled pad id, a real token of this vocab.)
    lengths = []
    generate = cluster.generate

    def counted(*a, **kw):
        out = generate(*a, **kw)
        lengths.extend(len(t) for t in out.tokens)
        return out

    cluster.generate = counted
    setup_s = time.perf_counter() - t
    learner.train(batches)
    if len(step_times) != args.steps + 1 or len(sample_times) != args.steps + 1:
        raise SystemExit(f"expected {args.steps + 1} steps, timed {len(step_times)} steps and "
                         f"{len(sample_times)} generations")
    updates = [s - g for s, g in zip(step_times, sample_times)]
    med = lambda xs: statistics.median(xs[1:]) if args.steps else None  # noqa: E731
    print("PEER_RESULT " + json.dumps({
        "side": "tunix", "version": f"google-tunix {version('google-tunix')}, jax "
                                    f"{jax.__version__}, flax {version('flax')}",
        "backend": jax.default_backend(), "devices": jax.device_count(),
        "params": int(sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))),
        "setup_s": setup_s, "first_s": step_times[0],
        "first": {"sample": sample_times[0], "update": updates[0]},
        "steady_s": med(step_times), "sample_s": med(sample_times), "update_s": med(updates),
        "completion_tokens": [min(lengths), max(lengths)], "steps": args.steps}), flush=True)


if __name__ == "__main__":
    main()
