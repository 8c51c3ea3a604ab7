"""Every recipe and rollout mode on several processes (jax.distributed on loopback, fake CPU
devices), as a pod slice's hosts run it.

Deterministic modes must give what the same config gives on one process with as many devices:
the same rollouts, evals and losses, and the same final params. Not bit for bit: a sum over
devices of two processes is reduced in another order than over one process's devices (XLA's
cross-process all-reduce), so floats may differ in their last bits; an update's metrics
(train/, critic/, sft/, dpo/, and a reward model's rm/ and ssrm/) are compared to a relative 1e-4 and params to an absolute 1e-5 (Adam normalises each update, so a rounding
difference in a gradient moves a weight by at most ~lr x 1e-6 a step). Counts, rewards and
success rates, which come from the sampled tokens, must be equal: a token that differs means
the hosts sampled differently. Free-running modes are not a function of the config (their
timing decides which version samples which chunk): they must finish, with no task trained
twice on any host.

A hang fails its test within the job's deadline (tests/multihost.py kills every process).
The cases CI runs are `slow`; the rest of the matrix is marked `multihost` too and runs with
    python -m pytest -q -m multihost tests/recipes/test_multihost.py
"""

import math

import numpy as np
import pytest

from multihost import run_job
from rl_tpu.metrics import read_metrics
from test_rl import _final_params
from rl_tpu.persistence import host_state
from test_rl import config
from test_rl_async import TRACE_SCRIPT, _assert_partition, _pending, _read_trace

pytestmark = pytest.mark.slow

REL = 1e-4
PARAMS_ATOL = 1e-5
# Adam divides each gradient component by its own running scale (+ eps 1e-8), so a component
# whose gradient is itself near eps (a head weight of a token the policy almost never samples)
# moves by a share of lr that a reduction summed in another order changes (seen: one lm_head
# element of 32,768 off by 1.7e-5 after a change of random stream). Such components are rare:
# at most PARAMS_STRAY of a tensor may differ by more than PARAMS_ATOL, none by more than
# PARAMS_MAX (2 x these configs' largest RL lr, 5e-4). A real difference between the runs
# (a row lost, a shard summed twice) moves whole rows, and shows in the metrics too.
PARAMS_STRAY = 1e-4
PARAMS_MAX = 1e-3
# Keys measured in each host's own terms (clocks, compile counts, a sampler's cache) or whose
# float noise is the point (a ratio that is 1 up to rounding).
SKIP_PREFIXES = ("time/", "compile/")
# An update's own numbers (losses, norms, ratios): floats reduced across devices.
UPDATE_PREFIXES = ("train/", "critic/", "sft/", "dpo/", "rm/", "ssrm/")
# A reward model's scores start at exactly 0 (a zero head) and stay near it in a smoke's few
# steps, where a relative bound means nothing; Adam's first steps move each head weight by
# ~lr x sign(its gradient), so a gradient component that is 0 up to rounding moves it either
# way: 1e-3 x a hidden state of ~1e-2 shows as a few 1e-6 in a mean reward.
# The train/logprob_gap_* keys are differences of two log-probs of the same tokens (the
# learner's recomputed and the sampler's), each float32 from programs sharded another way on 2
# processes than on one: their absolute error is the log-probs' own, ~1e-6 a token, however
# small the difference (seen: 2.5e-6 in a mean gap of 0.0146 on an AVX2 CPU, within REL on
# AVX-512). 1e-5 is still a thousandth of the gaps these runs log (~1e-2).
ABS_BY_PREFIX = {"rm/": 1e-4, "ssrm/": 1e-4, "train/logprob_gap_": 1e-5}


def _config_args(name: str, workdir, *overrides: str) -> list[str]:
    return ["--config", f"configs/{name}", "--workdir", str(workdir), *overrides]


def _records(workdir) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(SKIP_PREFIXES)}
            for r in read_metrics(str(workdir))]


def _assert_metrics_match(one, many, model_scored=()):
    """`model_scored`: keys a model computes from the sampled tokens (a reward model's
    rewards), compared to REL: a host scores its own rows, in batches of another size than
    one process's, and XLA's kernels for another batch shape round in other last bits."""
    a, b = _records(one), _records(many)
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        assert ra.keys() == rb.keys(), (ra["step"], sorted(ra.keys() ^ rb.keys()))
        for key in ra:
            x, y = ra[key], rb[key]
            if isinstance(x, float) and key in model_scored:
                assert y == pytest.approx(x, rel=REL, abs=1e-6), (ra["step"], key, x, y)
            elif isinstance(x, float) and key.startswith(UPDATE_PREFIXES) and not math.isnan(x):
                # a loss, norm or ratio of an update: a float reduced in another order
                bound = next((b for p, b in ABS_BY_PREFIX.items() if key.startswith(p)), 1e-6)
                assert y == pytest.approx(x, rel=REL, abs=bound), (ra["step"], key, x, y)
            else:
                assert x == y, (ra["step"], key, x, y)


def _assert_params_match(one, many):
    a, b = _final_params(one), _final_params(many)
    assert a.keys() == b.keys()
    for key in a:
        diff = np.abs(np.asarray(b[key], np.float64) - np.asarray(a[key], np.float64))
        stray = int(np.count_nonzero(diff > PARAMS_ATOL))
        assert stray <= PARAMS_STRAY * diff.size and diff.max() <= PARAMS_MAX, (
            key, f"{stray} of {diff.size} elements differ by more than {PARAMS_ATOL}",
            f"the largest by {diff.max():.3g}")


def _run_like_one(tmp_path, name, *overrides, processes=2, devices=2, final_hf=True,
                  model_scored=()):
    """`name` on `processes` x `devices` and on 1 x (processes * devices): same results."""
    one, many = tmp_path / "one", tmp_path / "many"
    single = run_job(_config_args(name, one, *overrides), 1, processes * devices,
                     str(tmp_path / "one_logs"))
    assert single.ok, single.tail()
    job = run_job(_config_args(name, many, *overrides), processes, devices,
                  str(tmp_path / "many_logs"))
    assert job.ok, job.tail()
    _assert_metrics_match(one, many, model_scored)
    if final_hf:
        _assert_params_match(one, many)


def test_async_deterministic_trains_like_one_process(tmp_path):
    """Lock-step at staleness 2 (the sampler on one device of each host, the learner's mesh
    over the others): weights reach each host's sampler from the main thread."""
    _run_like_one(tmp_path, "bapo_offpolicy.py:bapo,s2,smoke", "--config.train.steps=4",
                  "--config.sft.steps=30")


def test_rloop_trains_like_one_process(tmp_path):
    """Each host keeps its share of every step's successes, and every host fine-tunes on all
    of them (gathered), as one process holding every share would."""
    _run_like_one(tmp_path, "rloop_largest.py:smoke", final_hf=False)
    a = read_metrics(str(tmp_path / "one"))
    assert any(r.get("loop/kept", 0) > 0 for r in a), "nothing kept: the test shows nothing"


def test_reward_model_trains_like_one_process(tmp_path):
    """Each host samples its share of the pairs (seeds keyed by task position), every host
    trains on all of them (gathered) and scores every held-out and pool pair on its own
    devices: one process's pairs, losses, accuracies and pseudo-labels."""
    _run_like_one(tmp_path, "reward_model_largest.py:ssrm,smoke", final_hf=False)
    rounds = [r for r in read_metrics(str(tmp_path / "one")) if "rm/eval_accuracy" in r]
    assert len(rounds) == 2 and rounds[0]["rm/train_pairs"] > 0


def test_rl_against_a_reward_model_trains_like_one_process(tmp_path):
    """Each host scores its own rollouts with its own copy of the reward model, on its own
    devices (no collective off the main thread); the per-source means are over every host."""
    rm_job = run_job(_config_args("reward_model_largest.py:smoke", tmp_path / "rm"), 1, 4,
                     str(tmp_path / "rm_logs"))
    assert rm_job.ok, rm_job.tail()
    _run_like_one(tmp_path, "rlhf_largest.py:rm,smoke",
                  f"--config.reward.model_path={tmp_path / 'rm' / 'reward_model_hf'}",
                  "--config.reward.rule_weight=0.5",
                  model_scored=("rollout/reward", "rollout/reward_model"))
    steps = [r for r in read_metrics(str(tmp_path / "many")) if "rollout/reward_model" in r]
    assert len(steps) == 2


@pytest.mark.multihost
def test_rl_with_a_frozen_judge_trains_like_one_process(tmp_path):
    """Each host asks its own copy of the judge (a tiny random model: its replies are no
    verdicts, so every row leaves the loss and is counted) on its own devices."""
    import subprocess
    import sys
    judge = tmp_path / "judge"
    made = subprocess.run([sys.executable, "-m", "launch.make_tiny_model", f"--out={judge}",
                           "--num_layers=1"], capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr[-2000:]
    _run_like_one(tmp_path, "quickstart.py:smoke", "--config.reward.judge=pointwise",
                  f"--config.reward.judge_model_path={judge}", final_hf=False)
    steps = [r for r in read_metrics(str(tmp_path / "many")) if "rollout/judge_unparsed" in r]
    assert len(steps) == 2 and all(r["rollout/judge_unparsed"] == 1.0 for r in steps)


def test_free_running_with_replay_loses_and_repeats_no_task(tmp_path, monkeypatch):
    """A free-running producer on each host (hosts run at their own pace) with replay: each
    host evicts its own groups by their versions, and every host replays as many as the
    emptiest one can, so the global batch always has its rows. Every stream position a host
    read is trained fresh once, still pending at the end (its final host state), or counted
    as dropped stale; no position is trained by both hosts."""
    script = tmp_path / "traced.py"
    script.write_text(TRACE_SCRIPT)
    monkeypatch.setenv("RL_TPU_TEST_TRACE", str(tmp_path / "trace"))
    steps = 6
    args = [str(script), *_config_args(
        "bapo_offpolicy.py:bapo,replay,smoke", tmp_path / "run", f"--config.train.steps={steps}",
        "--config.rollout.max_staleness=1", "--config.rollout.deterministic=False")]
    job = run_job(args, 2, 2, str(tmp_path / "logs"), module=None)
    assert job.ok, job.tail()
    records = [r for r in read_metrics(str(tmp_path / "run")) if "rollout/reward" in r]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert any(r["replay/groups"] > 0 for r in records)

    n = config("bapo_offpolicy:bapo,replay").train.tasks_per_step  # the smoke's: 4
    per_host = n // 2
    fresh, pending, read = [], [], []
    for pid in range(2):
        by_step = _read_trace(tmp_path / f"trace.{pid}")
        assert sorted(by_step) == list(range(1, steps + 1))
        seen = []
        for step in sorted(by_step):
            groups = by_step[step]
            assert len(groups) == len(set(groups)), f"host {pid} step {step}: a group twice"
            seen += [g for g in groups if g not in seen]  # first time: fresh; later: replayed
        final = host_state.read(host_state.path(str(tmp_path / "run" / "checkpoints" / "host"),
                                                steps, pid))
        fresh.append(seen)
        pending.append(_pending(final))
        # host h reads positions [s * n + h * n / 2, ...) of each stream step s it read
        read += [s * n + pid * per_host + i for s in range(final["producer"]["stream"]["step"])
                 for i in range(per_host)]
    assert not set(fresh[0]) & set(fresh[1]), "both hosts trained the same task"
    dropped = int(sum(r["rollout/dropped_stale"] for r in records))  # summed over hosts
    _assert_partition(read, fresh[0] + fresh[1], pending[0] + pending[1], dropped,
                      "over both hosts")


# ---------------------------------------------------------------- the rest of the matrix


@pytest.mark.multihost
@pytest.mark.parametrize("name,overrides,devices", [
    ("quickstart.py:smoke", ("--config.rollout.sampler_devices=1",), 2),
    ("bapo_offpolicy.py:clip,replay,smoke", (), 2),
    ("quickstart.py:smoke", ("--config.algo.name=ppo", "--config.algo.advantage=gae"), 2),
    # TL-GRPO's BabyAI model on 2 x 2 fake devices: the hosts' Gloo all-reduces inside the
    # update paired wrongly ("Received data size doesn't match expected size", 16384 vs 4
    # bytes) although both hosts built identical batches and issued identical host
    # collectives (traced): XLA:CPU runs independent collectives of one program concurrently,
    # in an order of its own on each process. 2 x 1 runs it; so does every TPU, where the
    # compiler orders collectives. Unscanned layers: the scanned update's in-process
    # all-reduce deadlocks now and then (tests/recipes/test_rl.py's _train_smoke).
    ("tl_grpo_babyai.py:smoke", ("--config.model.scan_layers=False",), 1),
    # LoRA: adapters trained on a frozen base, synced alone to each host's sampler; with a
    # critic (its adapters and value head); asynchronous at staleness 2
    ("quickstart.py:smoke", ("--config.rollout.sampler_devices=1", "--config.model.lora.rank=4",
                             "--config.sft.steps=30", "--config.optim.lr=0.005"), 2),
    ("quickstart.py:smoke", ("--config.algo.name=ppo", "--config.algo.advantage=gae",
                             "--config.model.lora.rank=4", "--config.sft.steps=30"), 2),
    ("bapo_offpolicy.py:bapo,s2,smoke", ("--config.train.steps=4", "--config.sft.steps=30",
                                         "--config.model.lora.rank=4"), 2),
    # a mixture of experts replaying the sampler's routing, asynchronous at staleness 2: the
    # learner's mesh (one device a host) is an expert axis across the two hosts. The sampler
    # in float32 and without tensor parallelism: one process's sampler has 2 devices, each
    # host's here 1, and partial sums in another order round otherwise (a router's near-tie
    # then routes a token elsewhere)
    ("moe_replay.py:replay,smoke", ("--config.train.steps=4", "--config.sft.steps=30",
                                    "--config.mesh.expert=2", "--config.model.sampler_dtype=",
                                    "--config.rollout.sampler_tensor=1"), 2),
], ids=["rl_sync", "sync_replay", "ppo_critic", "tl_grpo", "lora", "lora_ppo_critic",
        "lora_async", "moe_replay_async"])
def test_deterministic_recipes_train_like_one_process(tmp_path, name, overrides, devices):
    _run_like_one(tmp_path, name, *overrides, devices=devices)


@pytest.mark.multihost
@pytest.mark.parametrize("name", ["dpo_largest.py:smoke", "reward_model_largest.py:ssrm,smoke"],
                         ids=["online_dpo", "reward_model_ssrm"])
def test_lora_loops_train_like_one_process(tmp_path, name):
    """LoRA in a loop of rounds: every host trains the same round adapters on its P_r, merges
    them into P_{r+1} and draws the next round's alike. The adapters start on a fully
    warm-started base (a random tiny model's replies all fail alike: no pairs)."""
    base = run_job(_config_args("quickstart.py:smoke", tmp_path / "base", "--config.train.steps=0",
                                "--config.sft.steps=30"), 1, 1, str(tmp_path / "base_logs"))
    assert base.ok, base.tail()
    _run_like_one(tmp_path, name, "--config.model.lora.rank=4", "--config.sft.steps=0",
                  f"--config.model.path={tmp_path / 'base' / 'final_hf'}", final_hf=False)
    rounds = [r for r in read_metrics(str(tmp_path / "one"))
              if r.get("loop/pairs", 0) > 0 or r.get("rm/train_pairs", 0) > 0]
    assert rounds, "no round had pairs: nothing trained"


@pytest.mark.multihost
def test_four_processes_of_one_device(tmp_path):
    """The synchronous loop on 4 hosts of one device each. (Lock-step asynchronous needs a
    device a host for its sampler beside the learner's, and is refused on servers the hosts
    share: it has no 4 x 1 form.)"""
    _run_like_one(tmp_path, "quickstart.py:smoke", processes=4, devices=1)


@pytest.mark.multihost
@pytest.mark.parametrize("name", ["expert_iteration_largest.py:smoke", "dpo_largest.py:smoke",
                                  "selfplay_arithmetic.py:smoke",
                                  "bapo_offpolicy.py:bapo,partial,smoke"],
                         ids=["expert_iteration", "online_dpo", "selfplay", "partial"])
def test_loops_and_free_running_modes_finish(tmp_path, name):
    job = run_job(_config_args(name, tmp_path / "run"), 2, 2, str(tmp_path / "logs"))
    assert job.ok, job.tail()
    assert read_metrics(str(tmp_path / "run")), "no metrics written"


@pytest.mark.multihost
def test_sft_trains_like_one_process(tmp_path):
    one, many = tmp_path / "one", tmp_path / "many"
    args = ["--config", "configs/quickstart.py:smoke"]
    single = run_job([*args, "--workdir", str(one)], 1, 4, str(tmp_path / "l1"),
                     module="launch.sft")
    assert single.ok, single.tail()
    job = run_job([*args, "--workdir", str(many)], 2, 2, str(tmp_path / "l2"),
                  module="launch.sft")
    assert job.ok, job.tail()
    _assert_metrics_match(one, many)



# ---------------------------------------------------------------- servers every host shares


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory):
    """rl_tpu's own SGLang-compatible server on the math_sglang smoke's tiny model, which
    every host of a job sends its rollouts to (process 0 alone loads new weights into it)."""
    from rl_tpu.recipes import policy_io
    from test_rl_sglang import _smoke_config  # puts tests/rollout on the path
    from sglang_server import start_rollout_server
    config = _smoke_config()
    model_dir = policy_io.model_path(config, str(tmp_path_factory.mktemp("shared")))
    server = start_rollout_server(model_dir)
    yield model_dir, server.url
    server.stop()


@pytest.mark.multihost
@pytest.mark.xdist_group("rollout_servers")
@pytest.mark.parametrize("staleness", [0, 1], ids=["synchronous", "free_running"])
def test_hosts_sharing_servers_sample_the_version_each_step_names(tmp_path, shared_server,
                                                                  staleness):
    """Two hosts on one server: process 0 loads each version, and no host samples before the
    server holds it (a barrier on the main thread), so synchronous step s samples with
    version s - 1 on every host and every eval at step s with version s."""
    model_dir, url = shared_server
    args = _config_args("math_sglang.py:smoke", tmp_path / "run", f"--rollout_urls={url}",
                        f"--config.model.path={model_dir}", "--config.train.steps=3",
                        "--config.eval.every=1", f"--config.rollout.max_staleness={staleness}",
                        "--config.rollout.deterministic=False")
    job = run_job(args, 2, 1, str(tmp_path / "logs"))
    assert job.ok, job.tail()
    records = read_metrics(str(tmp_path / "run"))
    evals = [(r["step"], r["eval/weight_version"]) for r in records if "eval/success" in r]
    assert evals == [(0, 0), (1, 1), (2, 2), (3, 3)]
    if not staleness:  # the oldest version of any host's tokens
        rollouts = [(r["step"], r["rollout/weight_version"]) for r in records
                    if "rollout/reward" in r]
        assert rollouts == [(1, 0), (2, 1), (3, 2)]


@pytest.fixture
def shared_lora_server(tmp_path):
    """As `shared_server`, with LoRA adapters on (rank 4; 2 versions kept + 1 loading + 1 a
    host may still name)."""
    from rl_tpu.recipes import policy_io
    from test_rl_sglang import _smoke_config  # puts tests/rollout on the path
    from sglang_server import start_rollout_server
    model_dir = policy_io.model_path(_smoke_config(), str(tmp_path / "shared"))
    server = start_rollout_server(model_dir, "--enable_lora", "--max_lora_rank=4",
                                  "--max_loaded_loras=4")
    yield model_dir, server.url
    server.stop()


@pytest.mark.multihost
@pytest.mark.xdist_group("rollout_servers")
def test_free_running_lora_hosts_name_only_adapters_the_server_holds(tmp_path,
                                                                      shared_lora_server):
    """Two free-running hosts, LoRA, one server: process 0 loads each adapter version while
    both learners train on; the other host names a version only after the barrier that
    follows that load (before, its requests could name an adapter the server did not hold
    yet: a 400 that ended the run), and process 0 unloads none a host may still name. The
    server's adapters carry the run's id."""
    import httpx
    from rl_tpu.rollout.adapter_versions import run_id_of
    model_dir, url = shared_lora_server
    steps = 4
    args = _config_args("math_sglang.py:smoke", tmp_path / "run", f"--rollout_urls={url}",
                        f"--config.model.path={model_dir}", f"--config.train.steps={steps}",
                        "--config.model.lora.rank=4", "--config.model.lora.alpha=8",
                        "--config.rollout.max_staleness=1",
                        "--config.rollout.deterministic=False")
    job = run_job(args, 2, 1, str(tmp_path / "logs"))
    assert job.ok, job.tail()
    records = [r for r in read_metrics(str(tmp_path / "run")) if "rollout/reward" in r]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert all(r["rollout/staleness_max"] <= 1 for r in records)
    assert max(r["rollout/weight_version"] for r in records) >= 1  # adapters sampled
    loaded = httpx.get(f"{url}/server_info").json()["loaded_adapters"]
    run_id = run_id_of(str(tmp_path / "run" / "sync"))
    assert loaded and all(name.startswith(run_id + "-") for name in loaded), loaded


@pytest.mark.multihost
def test_lock_step_on_shared_servers_is_refused_on_several_hosts(tmp_path):
    args = _config_args("math_sglang.py:smoke", tmp_path / "run",
                        "--rollout_urls=http://127.0.0.1:9", "--config.rollout.max_staleness=1",
                        "--config.rollout.deterministic=True")
    job = run_job(args, 2, 1, str(tmp_path / "logs"), timeout_s=300)
    assert all(code != 0 for code in job.returncodes), job.tail()
    assert all("cannot run on 2 hosts" in log for log in job.logs), job.tail()
