"""`judge_pairwise` and `judge_pointwise`: train an LLM judge by RL. A `judge_pairwise` task
is a question with two replies of known preference; the env shows them as A and B in a seeded
random order, and the agent's reply is a verdict in rl_tpu/rewards/judge.py's format:

    env = make("judge_pairwise")             # pairs generated from the `largest` task
    env.reset(task) -> "Question:\\nWhich number is largest? 3 7 2 5 1\\n\\nReply A:\\n5\\n\\n
                        Reply B:\\n7\\n\\nWhich reply is better? Answer [[A]] or [[B]]."
    env.step("[[B]]") -> reward 1.0, done, success

One reply an episode. Reward 1.0 when the verdict picks the preferred reply, 0.0 when it picks
the other, and 0.0 when the reply is no verdict (`parse_pairwise`: none, two different ones, an
unknown `[[word]]`). The system prompt and the user message are exactly `pairwise_messages`,
the prompt a judge reward asks a trained judge with.

Info keys, on every step: `success` (picked the preferred reply), `format_valid` (the reply
was a verdict), `verdict` ("A"/"B", None when unparseable), `preferred` ("A"/"B"); an
unparseable reply adds `invalid_action: True` and `parse_error`. Each step also reports
`violation` (the verdict picked the rejected reply; False when unparseable), the house keys of
the alignment-tipping envs, so the rollout and eval metrics count verdicts without new code:
`format_valid_rate` = parsed verdicts / replies and `violation_rate` = wrong picks / parsed
verdicts (1 - the judge's accuracy where it gave a verdict).

Tasks come from one of two sources:
  - generated (default, no data): the `largest` task's lists. Task i of a split draws from
    `Random(split_seed + i)` a list of `num_items` integers in [0, max_value] (not all equal),
    the preferred reply its largest number, the rejected reply one of its smaller numbers
    (uniformly among the distinct ones), and the order: the preferred reply is A or B with
    probability 1/2 each. Train and eval seed ranges are disjoint (checked).
  - `pairs_path`: a preference JSONL (rl_tpu/data/pairs.py: "prompt", "chosen", "rejected").
    When any line names a "split", lines marked "eval" are the eval split and the rest train;
    otherwise a prompt goes to eval when a hash of (holdout_seed, its text) falls under
    `eval_fraction`, so all pairs of one prompt land on the same side and the split survives
    reordering the file. Task i of a split is that split's i-th pair (file order), its A/B
    order drawn from `Random(split_seed + i)` as above; `train_size`/`eval_size` cap a split.
    Messages are shown as judge.render writes them.

The teacher (`teacher_reply`, for the SFT warm start) is right with probability `skill`;
otherwise it answers "[[A]]", whichever reply is preferred: position bias, the systematic
mistake LLM judges are known for (Zheng et al. 2023). Its accuracy is therefore
skill + (1 - skill) / 2 (the preferred reply is A half the time): 0.75 at skill 0.5. A model
that imitates it samples "[[A]]" about three times in four, and greedy decoding can turn that
into "[[A]]" always (configs/judge_largest.py's warm start: greedy accuracy equal to the share
of pairs whose preferred reply is A); sampling still picks B often enough for the exact reward
to teach the rule the teacher only half follows.

`judge_pointwise` is the same with one reply and the verdict [[YES]] or [[NO]] (is it
correct?), generated only (a preference pair says which reply is better, not that the better
one is correct): task i draws a `largest` pair as above and shows its answer or its smaller
number with probability 1/2 each. Reward 1.0 for the right verdict; the info keys as above,
`expected` (True: the reply is correct) in place of `preferred`. Its teacher is right with
probability `skill`, otherwise it says [[YES]] (leniency: a judge that accepts what it is
shown), so it is also right skill + (1 - skill) / 2 of the time.
"""

from __future__ import annotations

import hashlib
import random
from typing import Optional

from rl_tpu.core.env import Env, SeededTasks, StepResult, Task, register
from rl_tpu.data.pairs import PreferencePair, read_preference_pairs
from rl_tpu.envs.largest import question as largest_question
from rl_tpu.rewards import judge


def largest_pair(rng: random.Random, num_items: int, max_value: int) -> dict:
    """A generated pair: the `largest` question, its answer preferred over a smaller number of
    the list (the list is redrawn until it has one; the draws are all from `rng`)."""
    numbers = [rng.randint(0, max_value) for _ in range(num_items)]
    while len(set(numbers)) < 2:
        numbers = [rng.randint(0, max_value) for _ in range(num_items)]
    smaller = sorted({n for n in numbers if n < max(numbers)})
    return {"numbers": numbers, "question": largest_question(numbers),
            "chosen": str(max(numbers)), "rejected": str(rng.choice(smaller))}


def holdout_split(pairs: list[PreferencePair], eval_fraction: float,
                  holdout_seed: int) -> dict[str, list[PreferencePair]]:
    """The pairs by split: their own "split" fields when any has one (unmarked lines train),
    else a seeded hash of each prompt's text (module docstring)."""
    out: dict[str, list[PreferencePair]] = {"train": [], "eval": []}
    marked = any(p.split is not None for p in pairs)
    for pair in pairs:
        if marked:
            to_eval = pair.split == "eval"
        else:
            text = f"{holdout_seed}/{judge.render(pair.prompt)}".encode()
            hashed = int.from_bytes(hashlib.sha256(text).digest()[:8], "big") / 2**64
            to_eval = hashed < eval_fraction
        out["eval" if to_eval else "train"].append(pair)
    return out


def teacher_reply(task: Task, rng: random.Random, skill: float) -> str:
    """The imperfect teacher: the preferred reply's letter with probability `skill`, else
    "[[A]]" (position bias; module docstring)."""
    return f"[[{task.data['preferred']}]]" if rng.random() < skill else "[[A]]"


@register("judge_pairwise")
class PairwiseJudgeEnv(Env):
    """Judge which of two replies is better; paid for agreeing with the known preference."""

    name = "judge_pairwise"
    system_prompt = judge.PAIRWISE_SYSTEM
    replayable = True  # one deterministic step: the same verdict always scores the same

    def __init__(self, pairs_path: str = "", eval_fraction: float = 0.1, holdout_seed: int = 0,
                 num_items: int = 5, max_value: int = 9, train_seed: int = 1_000_000,
                 eval_seed: int = 0, train_size: int = 1_000_000, eval_size: int = 1000):
        if num_items < 2:
            raise ValueError(f"num_items={num_items}: a list needs at least 2 numbers")
        if max_value < 1:
            raise ValueError(f"max_value={max_value} must be >= 1 (two different numbers)")
        if not 0.0 < eval_fraction < 1.0:
            raise ValueError(f"eval_fraction={eval_fraction} must be in (0, 1)")
        self.num_items, self.max_value = num_items, max_value
        self._pairs: Optional[dict[str, list[PreferencePair]]] = None
        if pairs_path:
            self._pairs = holdout_split(read_preference_pairs(pairs_path), eval_fraction,
                                        holdout_seed)
            for split, held in self._pairs.items():
                if not held:
                    raise ValueError(f"{pairs_path}: no {split} pairs (mark lines \"split\": "
                                     "\"eval\", or change eval_fraction / holdout_seed)")
            train_size = min(train_size, len(self._pairs["train"]))
            eval_size = min(eval_size, len(self._pairs["eval"]))
        self._tasks = SeededTasks("judge_pairwise", self._draw, train_seed, eval_seed,
                                  train_size, eval_size)
        self._task: Optional[Task] = None

    def _draw(self, rng: random.Random, split: str, index: int) -> dict:
        if self._pairs is None:
            pair = largest_pair(rng, self.num_items, self.max_value)
        else:
            source = self._pairs[split][index]
            pair = {"question": judge.render(source.prompt), "chosen": judge.render(source.chosen),
                    "rejected": judge.render(source.rejected), "where": source.where}
        preferred = "A" if rng.random() < 0.5 else "B"
        pair["preferred"] = preferred
        pair["reply_a"], pair["reply_b"] = ((pair["chosen"], pair["rejected"]) if preferred == "A"
                                            else (pair["rejected"], pair["chosen"]))
        return pair

    def tasks(self) -> SeededTasks:
        return self._tasks

    def teacher_reply(self, task: Task, rng: random.Random, skill: float) -> str:
        """The imperfect teacher's reply (module docstring), for SFT demonstrations."""
        return teacher_reply(task, rng, skill)

    def reset(self, task: Task) -> str:
        data = task.data or {}
        if data.get("preferred") not in judge.PAIRWISE_VERDICTS or not all(
                isinstance(data.get(k), str) for k in ("question", "reply_a", "reply_b")):
            raise ValueError(f"task {task.task_id!r} needs 'question', 'reply_a', 'reply_b' and "
                             "'preferred' (A or B); take tasks from env.tasks().get(split, index)")
        self._task = task
        return judge.pairwise_user(data["question"], data["reply_a"], data["reply_b"])

    def step(self, action: str) -> StepResult:
        if self._task is None:
            return _over()
        preferred, self._task = self._task.data["preferred"], None
        return _scored(judge.parse_pairwise(action), preferred, "Reply [[A]] or [[B]]",
                       f"{preferred} is the better reply", preferred=preferred)


def _over() -> StepResult:
    return StepResult("The episode is over; call reset to start a new one.", 0.0, True,
                      {"invalid_action": True, "violation": False, "format_valid": False,
                       "episode_over": True})


def _scored(verdict: judge.Verdict, right_value, ask: str, truth: str, **info) -> StepResult:
    """The one step of a judge episode: 1.0 for the expected verdict, 0.0 for another or none,
    with the info keys of the module docstring."""
    info.update(verdict=verdict.value, format_valid=verdict.ok)
    if not verdict.ok:
        info.update(success=False, violation=False, invalid_action=True,
                    parse_error=verdict.error)
        return StepResult(f"No verdict: {verdict.error}. {ask}; {truth}.", 0.0, True, info)
    right = verdict.value == right_value
    info.update(success=right, violation=not right)
    return StepResult(f"{'Correct' if right else 'Not correct'}: {truth}.", float(right), True,
                      info)


def pointwise_teacher_reply(task: Task, rng: random.Random, skill: float) -> str:
    """The imperfect pointwise teacher: the right verdict with probability `skill`, else
    "[[YES]]" (leniency: it accepts a wrong reply; module docstring)."""
    right = "[[YES]]" if task.data["correct"] else "[[NO]]"
    return right if rng.random() < skill else "[[YES]]"


@register("judge_pointwise")
class PointwiseJudgeEnv(Env):
    """Judge whether one reply is correct; generated from `largest` (module docstring)."""

    name = "judge_pointwise"
    system_prompt = judge.POINTWISE_SYSTEM
    replayable = True

    def __init__(self, num_items: int = 5, max_value: int = 9, train_seed: int = 1_000_000,
                 eval_seed: int = 0, train_size: int = 1_000_000, eval_size: int = 1000):
        if num_items < 2:
            raise ValueError(f"num_items={num_items}: a list needs at least 2 numbers")
        if max_value < 1:
            raise ValueError(f"max_value={max_value} must be >= 1 (two different numbers)")
        self.num_items, self.max_value = num_items, max_value
        self._tasks = SeededTasks("judge_pointwise", self._draw, train_seed, eval_seed,
                                  train_size, eval_size)
        self._task: Optional[Task] = None

    def _draw(self, rng: random.Random, split: str, index: int) -> dict:
        del split, index  # both splits draw alike, from their own seeds
        pair = largest_pair(rng, self.num_items, self.max_value)
        correct = rng.random() < 0.5
        return {"numbers": pair["numbers"], "question": pair["question"],
                "reply": pair["chosen"] if correct else pair["rejected"], "correct": correct}

    def tasks(self) -> SeededTasks:
        return self._tasks

    def teacher_reply(self, task: Task, rng: random.Random, skill: float) -> str:
        """The imperfect teacher's reply (module docstring), for SFT demonstrations."""
        return pointwise_teacher_reply(task, rng, skill)

    def reset(self, task: Task) -> str:
        data = task.data or {}
        if not isinstance(data.get("correct"), bool) or not all(
                isinstance(data.get(k), str) for k in ("question", "reply")):
            raise ValueError(f"task {task.task_id!r} needs 'question', 'reply' and 'correct' "
                             "(a bool); take tasks from env.tasks().get(split, index)")
        self._task = task
        return judge.pointwise_user(data["question"], data["reply"])

    def step(self, action: str) -> StepResult:
        if self._task is None:
            return _over()
        correct, self._task = self._task.data["correct"], None
        return _scored(judge.parse_pointwise(action), correct, "Reply [[YES]] or [[NO]]",
                       f"the reply is {'correct' if correct else 'not correct'}",
                       expected=correct)
