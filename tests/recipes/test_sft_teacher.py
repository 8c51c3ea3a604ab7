"""Multi-turn teacher demonstrations (recipes/sft.py): a teacher played through whole episodes,
each of its turns carrying loss, token-exact with the agent loop's history."""

import random

import numpy as np
import pytest

from rl_tpu.core.env import Env, StepResult, Task, TaskSource
from rl_tpu.models.tiny_tokenizer import build_tokenizer
from rl_tpu.models.tokenizer import ChatTokenizer
from rl_tpu.recipes import sft


class CountTasks(TaskSource):
    def size(self, split):
        return 100

    def get(self, split, index):
        return Task(f"count_{index}", {"target": 3})


class UntaughtCountEnv(Env):
    """Say 1, then 2, then 3: three turns when every reply is right. A wrong reply repeats the
    prompt."""

    name = "count"
    system_prompt = "Count."

    def tasks(self):
        return CountTasks()

    def reset(self, task):
        self.next, self.target = 1, task.data["target"]
        return "Say 1"

    def step(self, action):
        if action.strip() == str(self.next):
            self.next += 1
        done = self.next > self.target
        return StepResult("Done" if done else f"Say {self.next}", float(done), done,
                          {"success": done})

    def close(self):
        pass


class CountEnv(UntaughtCountEnv):
    """With a teacher that answers right with probability `skill` (drawn per turn), else 0."""

    def teacher_reply(self, task, rng, skill):
        return str(self.next) if rng.random() < skill else "0"


@pytest.fixture(scope="module")
def tokenizer():
    return ChatTokenizer(build_tokenizer(512))


def test_teacher_episode_plays_until_done_and_drops_the_final_observation():
    messages, success = sft.teacher_episode(CountEnv(), CountTasks().get("train", 0),
                                            random.Random(0), 1.0, max_turns=5)
    assert success
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant",
                                             "user", "assistant"]
    assert [m["content"] for m in messages[2::2]] == ["1", "2", "3"]
    assert messages[-1] == {"role": "assistant", "content": "3"}  # "Done" is never followed


def test_teacher_success_respects_the_turn_limit():
    tasks = [CountTasks().get("eval", i) for i in range(4)]
    # a perfect teacher needs exactly 3 turns: 2 are not enough, 3 are
    assert sft.teacher_success(CountEnv, tasks, 1.0, seed=0, max_turns=2) == 0.0
    assert sft.teacher_success(CountEnv, tasks, 1.0, seed=0, max_turns=3) == 1.0
    assert sft.teacher_success(CountEnv, tasks, 0.0, seed=0, max_turns=10) == 0.0


def test_multi_turn_demo_masks_exactly_the_teacher_turns(tokenizer):
    task = CountTasks().get("train", 0)
    (ids, mask), = sft.teacher_examples(CountEnv, [task], tokenizer, 1.0, seed=0, max_turns=5)
    eos = tokenizer.eos_token_id
    # the trained tokens are the three replies, each with the eos that ends its turn
    trained = [i for i, m in zip(ids, mask) if m]
    assert trained == (tokenizer.encode("1") + [eos] + tokenizer.encode("2") + [eos]
                       + tokenizer.encode("3") + [eos])
    # the whole row is the chat template of the episode, as the agent loop builds it
    messages, _ = sft.teacher_episode(CountEnv(), task, random.Random(0), 1.0, max_turns=5)
    rendered = tokenizer.apply_chat_template(messages)
    assert ids == rendered[:len(ids)] and len(rendered) - len(ids) == 1  # the template's "\n"


def test_single_turn_demo_is_prompt_then_reply(tokenizer):
    task = CountTasks().get("train", 0)
    (ids, mask), = sft.teacher_examples(CountEnv, [task], tokenizer, 1.0, seed=0)
    env = CountEnv()
    prompt = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Count."}, {"role": "user", "content": env.reset(task)}],
        add_generation_prompt=True)
    assert ids == prompt + tokenizer.encode("1") + [tokenizer.eos_token_id]
    assert mask == [False] * len(prompt) + [True] * (len(ids) - len(prompt))


def test_env_without_teacher_is_a_clear_error(tokenizer):
    with pytest.raises(ValueError, match="has no teacher"):
        sft.teacher_examples(UntaughtCountEnv, [CountTasks().get("train", 0)], tokenizer, 1.0, 0)


def _lengths_of(batch):
    return batch["segment_ids"].sum(axis=1).tolist()


def test_length_grouped_batches_pad_to_their_own_bucket():
    # 8 examples of lengths 1..8 (given shuffled), batches of 2, buckets 2/4/6/8
    examples = [([7] * n, [True] * n) for n in (5, 2, 8, 1, 7, 3, 6, 4)]
    grouped = sft.ExampleBatches(examples, 2, (2, 4, 6, 8), seed=0, group_by_length=4)
    first_epoch = [next(grouped) for _ in range(4)]
    # sorted within the pool of 4 batches: {1,2}, {3,4}, {5,6}, {7,8}, in some order
    assert sorted(sorted(_lengths_of(b)) for b in first_epoch) == [[1, 2], [3, 4], [5, 6],
                                                                   [7, 8]]
    for b in first_epoch:  # each pads only to its own longest row's bucket
        assert b["tokens"].shape[1] == {2: 2, 4: 4, 6: 6, 8: 8}[max(_lengths_of(b))]
    # every example once per epoch, and the batch order itself is shuffled by the seed
    assert sorted(n for b in first_epoch for n in _lengths_of(b)) == list(range(1, 9))
    plain = sft.ExampleBatches(examples, 2, (2, 4, 6, 8), seed=0)
    assert sum(next(plain)["tokens"].shape[1] for _ in range(4)) > \
        sum(b["tokens"].shape[1] for b in first_epoch)


def test_ungrouped_batches_keep_their_order():
    """group_by_length=0 is the shuffled order runs resumed from before it existed saw."""
    examples = [([7] * n, [True] * n) for n in range(1, 9)]
    expected = list(np.random.RandomState(3).permutation(8))
    got = sft.ExampleBatches(examples, 2, (8,), seed=3)
    assert [n - 1 for _ in range(4) for n in _lengths_of(next(got))] == expected
