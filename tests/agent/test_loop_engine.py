"""The agent loop with the real embedded sampler on a real env (BabyAI): the trajectories a
trainer receives carry exactly the sampled tokens and their log-probs."""

import numpy as np
import pytest

from rl_tpu.agent import run_episodes
from rl_tpu.core.engine import SamplingParams
from rl_tpu.core import env as env_lib
from rl_tpu.models import hf, tiny
from rl_tpu.models.logprobs import token_logprobs
from rl_tpu.models.tokenizer import load_tokenizer
from rl_tpu.models.transformer import Transformer
from rl_tpu.rollout.sampler import JaxSampler

pytest.importorskip("minigrid")


# slow: 2 BabyAI tasks x 2 samples of 2k-token prompts (~20 s); the fast suite checks the same
# behaviour == trainer log-probs on one episode in test_trajectory_across_three_weight_versions
@pytest.mark.slow
def test_sampled_trajectories_match_the_trainer(tmp_path):
    path = str(tmp_path / "model")
    tiny.write_tiny_model(path, "qwen2", vocab_size=512)
    cfg, params = hf.load(path)
    tokenizer = load_tokenizer(path)
    engine = JaxSampler(cfg, params, tokenizer=tokenizer, version="v0")
    env = env_lib.make("babyai")
    tasks = [env.tasks().get("eval", i) for i in range(2)]
    env.close()
    trajectories = run_episodes(
        engine, lambda: env_lib.make("babyai"), tasks, tokenizer=tokenizer, max_turns=3,
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


class VersionPerTurn:
    """The real sampler, given version k+1's weights after its k-th generate call: each turn
    of an episode is sampled by the next weight version."""

    def __init__(self, sampler, versions):
        self.sampler, self.versions, self.calls = sampler, versions, 0

    def generate(self, requests):
        results = self.sampler.generate(requests)
        self.calls += 1
        if self.calls < len(self.versions):
            self.sampler.update_weights(self.versions[self.calls], str(self.calls))
        return results


def test_trajectory_across_three_weight_versions(tmp_path):
    import jax

    path = str(tmp_path / "model")
    tiny.write_tiny_model(path, "qwen2", vocab_size=512)
    cfg, params = hf.load(path)
    tokenizer = load_tokenizer(path)
    # three policies that differ: version v scales every weight by 1 + 0.3 v
    versions = [jax.tree.map(lambda x, v=v: x * (1 + 0.3 * v), params) for v in range(3)]
    engine = VersionPerTurn(JaxSampler(cfg, versions[0], tokenizer=tokenizer, version="0"),
                            versions)
    env = env_lib.make("babyai")
    task = env.tasks().get("eval", 0)
    env.close()
    [traj] = run_episodes(engine, lambda: env_lib.make("babyai"), [task], tokenizer=tokenizer,
                          max_turns=3, max_new_tokens_per_turn=8, max_context_tokens=2048,
                          sampling=SamplingParams(temperature=1.0, seed=0))
    assert traj.num_turns == 3, traj.finish
    assert traj.weight_versions == ["0", "1", "2"]
    mask, turns = np.asarray(traj.loss_mask), np.asarray(traj.turn_ids)
    model = Transformer(cfg)
    for v in range(3):
        mine = mask & (turns == v)
        assert mine.sum() > 0
        # every token of turn v carries version v, and its behaviour log-prob is version v's
        assert np.all(traj.token_versions[mine] == v)
        lp, _ = token_logprobs(model, versions[v], {"tokens": np.asarray(traj.tokens)[None]})
        np.testing.assert_allclose(traj.behaviour_logprobs[mine], np.asarray(lp)[0][mine],
                                   atol=1e-4)
    assert np.all(traj.token_versions[~mask] == -1)
    assert traj.oldest_version == 0


def test_partial_rollouts_resume_under_newer_weights_exactly(tmp_path):
    """A generation cut by the token budget goes on under the next weights: its turn's
    tokens carry several versions, each with exactly that version's log-prob."""
    import jax

    from rl_tpu.agent import play_partial

    path = str(tmp_path / "model")
    tiny.write_tiny_model(path, "qwen2", vocab_size=512)
    cfg, params = hf.load(path)
    tokenizer = load_tokenizer(path)
    versions = [jax.tree.map(lambda x, v=v: x * (1 + 0.05 * v), params) for v in range(8)]
    sampler = JaxSampler(cfg, versions[0], tokenizer=tokenizer, version="0")
    env = env_lib.make("largest")
    tasks = [env.tasks().get("eval", i) for i in range(2)]
    env.close()
    common = dict(tokenizer=tokenizer, max_turns=1, max_new_tokens_per_turn=6,
                  max_context_tokens=256, samples_per_task=2, token_budget=4,
                  sampling=SamplingParams(temperature=1.0, seed=0, stop_token_ids=(0,)))
    ended, paused = play_partial(sampler, lambda: env_lib.make("largest"), tasks, **common)
    version = 0
    while paused:  # 4 episodes share 4 tokens a call: 1 each, then the next weights
        version += 1
        sampler.update_weights(versions[version], str(version))
        more, paused = play_partial(sampler, lambda: env_lib.make("largest"), [], resume=paused,
                                    **common)
        ended += more
    assert len(ended) == 4 and version >= 2
    model = Transformer(cfg)
    spanning = 0
    for traj in ended:
        mask = np.asarray(traj.loss_mask)
        seen = sorted(set(traj.token_versions[mask].tolist()))
        spanning += len(seen) > 1
        for v in seen:
            mine = mask & (traj.token_versions == v)
            lp, _ = token_logprobs(model, versions[v], {"tokens": np.asarray(traj.tokens)[None]})
            np.testing.assert_allclose(traj.behaviour_logprobs[mine], np.asarray(lp)[0][mine],
                                       atol=1e-4)
    assert spanning == 4  # every episode's one turn was sampled by several versions
