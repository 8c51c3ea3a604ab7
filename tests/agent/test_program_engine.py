"""An agent program against the real embedded sampler: the trajectories the recording endpoint
builds carry exactly the sampled tokens, and their behaviour log-probs are the trainer's own
log-probs of those tokens (1e-4, fp32), on every call of a multi-turn conversation."""

import numpy as np

from rl_tpu.agent.program import play_programs
from rl_tpu.core.engine import SamplingParams
from rl_tpu.core import env as env_lib
from rl_tpu.models import hf, tiny
from rl_tpu.models.logprobs import token_logprobs
from rl_tpu.models.tokenizer import load_tokenizer
from rl_tpu.models.transformer import Transformer
from rl_tpu.rollout.sampler import JaxSampler


def test_program_trajectories_match_the_trainers_logprobs(tmp_path):
    path = str(tmp_path / "model")
    tiny.write_tiny_model(path, "qwen2", vocab_size=512)
    cfg, params = hf.load(path)
    tokenizer = load_tokenizer(path)
    engine = JaxSampler(cfg, params, tokenizer=tokenizer, version="3")

    def make_env():
        return env_lib.make("agent_program", program="rl_tpu.envs.agent_programs:arithmetic_agent",
                         tasks="rl_tpu.envs.agent_programs:arithmetic_tasks")

    source = make_env().tasks()
    tasks = [source.get("train", i) for i in range(2)]
    trajs = play_programs(engine, make_env, tasks, tokenizer=tokenizer, max_turns=2,
                          max_new_tokens_per_turn=8, max_context_tokens=256, samples_per_task=2,
                          sampling=SamplingParams(temperature=1.0, seed=0))
    assert [t.group_id for t in trajs] == [0, 0, 1, 1]
    model = Transformer(cfg)
    for traj in trajs:
        assert traj.finish == "done", traj.info.get("error")
        assert traj.num_turns == 2 and traj.info["segments"] == 1
        assert traj.weight_versions == ["3", "3"]
        mask = np.asarray(traj.loss_mask)
        assert list(np.unique(traj.turn_ids[mask])) == [0, 1]  # both calls' replies train
        assert (traj.token_versions[mask] == 3).all() and (traj.token_versions[~mask] == -1).all()
        lp, _ = token_logprobs(model, params, {"tokens": np.asarray(traj.tokens)[None]})
        np.testing.assert_allclose(traj.behaviour_logprobs[mask], np.asarray(lp)[0][mask],
                                   atol=1e-4)
        assert np.all(traj.behaviour_logprobs[~mask] == 0)
    # two samples of one task drew different replies (their own seeds)
    assert list(trajs[0].tokens) != list(trajs[1].tokens)
