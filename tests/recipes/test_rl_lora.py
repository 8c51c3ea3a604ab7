"""LoRA through the RL recipe: an asynchronous run's behaviour log-probs are exactly those of
the adapter version that sampled each token, a checkpoint holds the adapters and their moments
only, and a run killed with SIGKILL resumes exactly."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from rl_tpu.metrics import read_metrics
from rl_tpu.models import lora
from rl_tpu.models.logprobs import token_logprobs
from rl_tpu.models.transformer import Transformer
from rl_tpu.recipes import policy_io, rl
from test_rl import REPO, _cpu_env, _final_params, _finite, config, kill_mid_run, resumed_from

# with a KL term, so the run's reference (the start's adapters on the base) is saved and
# restored too
LORA_FLAGS = ["--config.model.lora.rank=4", "--config.model.lora.alpha=8",
              "--config.optim.lr=0.005", "--config.sft.steps=0", "--config.algo.kl_coef=0.01"]


@pytest.fixture(scope="module")
def sft_base(tmp_path_factory):
    """The quickstart's tiny model after a full SFT warm start (no RL), as an HF dir: a LoRA
    run starts from a model that already answers, as LoRA RL starts from a pretrained one (on
    a random tiny model, adapters with its random embeddings and head frozen barely learn)."""
    workdir = tmp_path_factory.mktemp("sft_base")
    c = config("quickstart")
    c.sft.steps, c.train.steps = 30, 0
    rl.run(c, str(workdir))
    return str(workdir / "final_hf")


def lora_config(base: str, **overrides):
    c = config("quickstart")
    c.model.path, c.sft.steps = base, 0
    c.model.lora.rank, c.model.lora.alpha, c.optim.lr = 4, 8.0, 5e-3
    for key, value in overrides.items():
        node = c
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return c


class RecordingTrainer(rl.Trainer):
    """The trainer, keeping each published adapter version and each step's trajectories."""

    def start_producer(self) -> None:
        self.versions = {self.start: self._adapters()}
        self.trained = []
        super().start_producer()

    def _adapters(self):
        return jax.tree.map(np.asarray, lora.adapters(self.learner.policy.params))

    def train_step(self, step):
        trajectories, record = super().train_step(step)
        self.trained += trajectories
        return trajectories, record

    def sync(self, step):
        super().sync(step)
        self.versions[step] = self._adapters()

    def close(self, after_error=False):
        RecordingTrainer.last = self
        super().close(after_error)


def test_async_lora_behaviour_logprobs_are_their_adapter_versions(tmp_path, sft_base):
    """Free-running at staleness 2 on the embedded sampler: every trained token's behaviour
    log-prob equals the trainer's log-prob of it under the adapters of the version that sampled
    it (1e-4), and some tokens were sampled by an older version than the newest."""
    c = lora_config(sft_base, **{"rollout.max_staleness": 2, "train.steps": 6})
    rl.run(c, str(tmp_path), trainer_class=RecordingTrainer)
    _check_behaviour_logprobs(c, RecordingTrainer.last)


@pytest.mark.slow  # (not in the rollout_servers group: a tiny JAX server, no SGLang)
def test_async_lora_on_rl_tpus_own_server_samples_each_token_under_its_version(tmp_path,
                                                                               sft_base):
    """The same against rl_tpu's own rollout server with LoRA on (rollout.engine=sglang): the
    engine loads every version as an adapter and keeps max_staleness + 1 = 3 of them (+ 1 as it
    loads the next: --max_loaded_loras=4, the least it accepts), requests
    of several versions decode side by side, and each trained token's behaviour log-prob is
    its version's (1e-4)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "rollout"))
    from sglang_server import start_rollout_server

    server = start_rollout_server(sft_base, "--enable_lora", "--max_lora_rank=4",
                                  "--max_loaded_loras=4")
    try:
        c = lora_config(sft_base, **{"rollout.max_staleness": 2, "train.steps": 6,
                                     "rollout.engine": "sglang", "rollout.urls": server.url})
        rl.run(c, str(tmp_path / "run"), trainer_class=RecordingTrainer)
    finally:
        server.stop()
    _check_behaviour_logprobs(c, RecordingTrainer.last)
    assert sorted(os.listdir(tmp_path / "run" / "sync")) == ["adapter_4", "adapter_5",
                                                            "adapter_6"]


def _check_behaviour_logprobs(c, trainer):
    base = lora.without_adapters(jax.tree.map(np.asarray, trainer.learner.policy.params))
    model = Transformer(trainer.model_cfg)
    used, checked = set(), 0
    moved = [v for v in trainer.versions if v and any(
        np.abs(a - b).max() > 0 for a, b in zip(jax.tree.leaves(trainer.versions[v]),
                                                jax.tree.leaves(trainer.versions[v - 1])))]
    assert len(moved) >= 3, moved  # the adapters changed at most syncs
    for traj in trainer.trained:
        mask = traj.loss_mask
        versions = traj.token_versions[mask]
        for v in np.unique(versions):
            params = lora.with_adapters(base, trainer.versions[int(v)])
            lp, _ = token_logprobs(model, params, {"tokens": traj.tokens[None]},
                                   temperature=c.rollout.temperature, with_entropy=False)
            mine = mask & (traj.token_versions == v)
            np.testing.assert_allclose(traj.behaviour_logprobs[mine], np.asarray(lp)[0][mine],
                                       atol=1e-4, err_msg=f"version {v}")
            used.add(int(v))
            checked += int(mine.sum())
    assert checked > 100 and len(used) >= 3, (checked, used)


def test_a_lora_checkpoint_saves_adapters_and_moments_only(tmp_path, sft_base):
    c = lora_config(sft_base, **{"train.steps": 2, "algo.kl_coef": 0.01})
    rl.run(c, str(tmp_path), trainer_class=RecordingTrainer)
    trainer = RecordingTrainer.last
    n = lora.adapter_count(trainer.learner.policy.params)
    # the KL reference is the start's adapters alone, put on the policy's own base when scored
    reference = trainer.learner.reference_params
    assert not lora.without_adapters(reference) and lora.adapter_count(reference) == n
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, reference),
                 trainer.versions[0])
    target = trainer._checkpoint_state()
    arrays = [x for x in jax.tree.leaves(target) if np.ndim(x) > 0]
    assert sum(x.size for x in arrays) == 3 * n  # adapters, Adam's mu and nu
    # what orbax wrote: every array a param or a moment of an adapter, 3n numbers in all
    import orbax.checkpoint as ocp
    written = ocp.StandardCheckpointer().metadata(str(tmp_path / "checkpoints" / "2" / "state"))
    arrays = [(jax.tree_util.keystr(path), leaf) for path, leaf in
              jax.tree_util.tree_flatten_with_path(getattr(written, "item_metadata", written))[0]
              if len(leaf.shape) > 0]
    assert all(name.endswith(("['lora_a']", "['lora_b']")) for name, _ in arrays), arrays[:3]
    assert sum(int(np.prod(leaf.shape)) for _, leaf in arrays) == 3 * n
    assert (tmp_path / "final_hf" / "config.json").exists()  # merged, a plain HF model

    # the PEFT export starts the next run: model.lora.path loads the trained adapters
    adapter_dir = str(tmp_path / "final_adapter")
    c.model.lora.path = adapter_dir
    cfg, _, params, _ = policy_io.load_policy(c, sft_base, trainer.mesh)
    assert cfg.lora == trainer.model_cfg.lora
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, lora.adapters(params)),
                 jax.tree.map(np.asarray, lora.adapters(trainer.learner.policy.params)))
    c.model.lora.rank = 8
    with pytest.raises(ValueError, match=r"model.lora.rank=8 \(the adapter: 4\)"):
        policy_io.load_policy(c, sft_base, trainer.mesh)


def _lora_command(workdir, base):
    return [sys.executable, "-m", "launch.train", "--config", "configs/quickstart.py:smoke",
            "--workdir", str(workdir), "--config.train.steps=12", "--config.checkpoint.every=1",
            f"--config.model.path={base}", *LORA_FLAGS]


@pytest.mark.slow
def test_a_lora_run_killed_with_sigkill_resumes_exactly(tmp_path, sft_base):
    straight = tmp_path / "straight"
    done = subprocess.run(_lora_command(straight, sft_base), cwd=REPO, env=_cpu_env(),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    resumed = tmp_path / "resumed"
    complete = kill_mid_run(_lora_command(resumed, sft_base), resumed, tmp_path / "killed.log",
                            _cpu_env(), after=2)
    again = subprocess.run(_lora_command(resumed, sft_base), cwd=REPO, env=_cpu_env(),
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert complete <= resumed_from(again) < 12
    a = [_finite(r) for r in read_metrics(str(straight))]
    b = [_finite(r) for r in read_metrics(str(resumed))]
    assert any(r.get("train/grad_norm", 0) > 0 for r in a), "no update moved the adapters"
    assert a == b
    first, second = _final_params(straight), _final_params(resumed)
    for key in first:
        np.testing.assert_array_equal(second[key], first[key], err_msg=key)


@pytest.mark.slow
@pytest.mark.xdist_group("rollout_servers")
@pytest.mark.sglang_venv
def test_a_lora_run_on_sglang_syncs_adapters_alone(tmp_path, sft_base):
    """rollout.engine=sglang with LoRA: a real CPU SGLang server with LoRA on (its base the
    run's model.path) gets a PEFT adapter dir a version and nothing else; the run trains,
    sampling version k-1 at step k, and the engine keeps at most max_staleness + 1 adapters."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "rollout"))
    from sglang_server import lora_flags, lora_server_env, start_sglang_server

    server = start_sglang_server(sft_base, *lora_flags(),
                                 env=lora_server_env(str(tmp_path / "server_env")))
    try:
        c = lora_config(sft_base, **{"train.steps": 3, "rollout.engine": "sglang",
                                     "rollout.urls": server.url})
        rl.run(c, str(tmp_path / "run"), trainer_class=RecordingTrainer)
    finally:
        server.stop()
    records = [r for r in read_metrics(str(tmp_path / "run")) if "rollout/reward" in r]
    assert [r["rollout/weight_version"] for r in records] == [0, 1, 2]
    assert all(r["train/skipped"] == 0 for r in records)
    synced = sorted(os.listdir(tmp_path / "run" / "sync"))
    # only adapter dirs (no full HF export), the newest max_staleness + 1 = 1 of them kept
    assert synced == ["adapter_3"], synced
    assert set(os.listdir(tmp_path / "run" / "sync" / "adapter_3")) >= {
        "adapter_config.json", "adapter_model.safetensors"}
