"""The agent loop with the real embedded sampler on a real env (BabyAI): the trajectories a
trainer receives carry exactly the sampled tokens and their log-probs."""

import numpy as np
import pytest

from rl_tpu.agent import run_episodes
from rl_tpu.envs import base
from rl_tpu.models import hf, tiny
from rl_tpu.models.logprobs import token_logprobs
from rl_tpu.models.tokenizer import load_tokenizer
from rl_tpu.models.transformer import Transformer
from rl_tpu.rollout.engine import SamplingParams
from rl_tpu.rollout.sampler import JaxSampler

pytest.importorskip("minigrid")


def test_sampled_trajectories_match_the_trainer(tmp_path):
    path = str(tmp_path / "model")
    tiny.write_tiny_model(path, "qwen2", vocab_size=512)
    cfg, params = hf.load(path)
    tokenizer = load_tokenizer(path)
    engine = JaxSampler(cfg, params, tokenizer=tokenizer, version="v0")
    env = base.make("babyai")
    tasks = [env.tasks().get("eval", i) for i in range(2)]
    env.close()
    trajectories = run_episodes(
        engine, lambda: base.make("babyai"), tasks, tokenizer=tokenizer, max_turns=3,
        max_new_tokens_per_turn=12, max_context_tokens=2048, samples_per_task=2,
        sampling=SamplingParams(temperature=1.0, seed=0))
    assert len(trajectories) == 4 and [t.group_id for t in trajectories] == [0, 0, 1, 1]
    model = Transformer(cfg)
    for traj in trajectories:
        assert traj.num_turns >= 1 and traj.weight_versions[0] == "v0"
        tokens = np.asarray(traj.tokens)[None]
        lp, _ = token_logprobs(model, params, {"tokens": tokens})
        mask = np.asarray(traj.loss_mask)
        assert mask.sum() > 0 and not mask[0]
        # behaviour log-probs == the trainer's recomputation on the same tokens (fp32)
        np.testing.assert_allclose(np.asarray(traj.behaviour_logprobs)[mask],
                                   np.asarray(lp)[0][mask], atol=1e-4)
        assert np.all(np.asarray(traj.behaviour_logprobs)[~mask] == 0)
