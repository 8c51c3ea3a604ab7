"""Single-turn verifiable reasoning tasks from reasoning-gym generators, scored by their own
`score_answer`.

    make("countdown")                      # reach a target number with + - * /
    make("arithmetic")                     # reasoning-gym's basic_arithmetic
    make("reasoning_gym", dataset="maze", config={"min_dist": 3})   # any registered dataset

`arithmetic` also has an imperfect, verbose teacher (`arithmetic_teacher_reply`) for SFT warm
starts: filler sentences, the worked sum, the answer tag, right with probability `skill`.

An episode is one question and one reply: `reset` returns the question, `step` pulls the last
<answer>...</answer> out of the reply, scores it with the dataset's scorer (1.0 is right;
some datasets give partial credit, e.g. countdown's 0.05 for using the right numbers) and ends.

Tasks are reproducible by (seed, index): reasoning-gym builds item i of a dataset from
`Random(seed + i)`, so the train items (seeds `train_seed + i`) and eval items (seeds
`eval_seed + j`) come from disjoint generator seeds as long as the two ranges do not overlap,
which the constructor checks. Identical *text* can still occur in both splits for datasets with
few distinct items (small sums, say): disjoint seeds, not de-duplicated content.

Scorers run in an isolated worker process with a hard deadline by default (`isolate=True`),
because some never return on hostile input: countdown's evaluates `10**10**10` outright, a
C-level big-integer loop no signal or thread timeout can stop.
"""

from __future__ import annotations

import functools
import inspect
import random
from typing import Any, Optional

from rl_tpu.core.env import Env, StepResult, Task, TaskSource, register
from rl_tpu.env_serving.isolated import IsolatedWorkers, WorkerError, shared_workers
from rl_tpu.optional import require

SYSTEM_PROMPT = """Solve the task. Think it through, then give only the final answer inside
<answer>...</answer>, in exactly the format the task asks for, e.g. <answer>42</answer>.
Your reply is scored once: the episode ends after it."""

DEFAULT_TRAIN_SEED = 1_000_000
DEFAULT_EVAL_SEED = 0


def _import_reasoning_gym():
    # MissingDependency: the launchers report it in one line (launch/__init__.py)
    return require("reasoning_gym", extra="envs", needed_by="each reasoning env")


@functools.lru_cache(maxsize=64)
def _dataset(name: str, config_items: tuple, seed: int, size: int):
    """A reasoning-gym dataset; cached because some build lookup tables on construction."""
    reasoning_gym = _import_reasoning_gym()
    return reasoning_gym.create_dataset(name, seed=seed, size=size, **dict(config_items))


def score_entry(name: str, config_items: tuple, seed: int, size: int, entry: dict,
                answer: Optional[str]) -> float:
    """The dataset's own score for `answer` (top-level, so worker processes can run it)."""
    return float(_dataset(name, config_items, seed, size).score_answer(answer, entry))


def extract_answer(reply: str) -> Optional[str]:
    """The last <answer>...</answer> of a reply, stripped; None when there is none."""
    from reasoning_gym.utils import extract_answer as rg_extract

    return rg_extract(reply, tag_name="answer")


class ReasoningGymTasks(TaskSource):
    """Items of one reasoning-gym dataset: train = seed `train_seed`, eval = `eval_seed`."""

    def __init__(self, env: "ReasoningGymEnv"):
        self._env = env

    def size(self, split: str) -> int:
        self.check_split(split)
        return self._env.split_args(split)[1]

    def get(self, split: str, index: int) -> Task:
        self.check_split(split)
        seed, size = self._env.split_args(split)
        if not 0 <= index < size:
            raise IndexError(f"{split} has {size} tasks; index {index} is out of range")
        entry = _dataset(self._env.dataset, self._env.config_items, seed, size)[index]
        return Task(task_id=f"{self._env.dataset}/{split}/{index}",
                    data={"question": entry["question"], "answer": entry.get("answer"),
                          "metadata": entry.get("metadata", {}), "split": split, "index": index})


class ReasoningGymEnv(Env):
    """One reasoning-gym question per episode, scored once."""

    name = "reasoning_gym"
    system_prompt = SYSTEM_PROMPT

    def __init__(self, dataset: str, config: Optional[dict] = None,
                 train_seed: int = DEFAULT_TRAIN_SEED, train_size: int = 100_000,
                 eval_seed: int = DEFAULT_EVAL_SEED, eval_size: int = 500,
                 isolate: bool = True, score_timeout_s: float = 10.0,
                 max_answer_chars: int = 10_000, workers: Optional[IsolatedWorkers] = None,
                 system_prompt: Optional[str] = None):
        _import_reasoning_gym()  # a clear ImportError before anything else
        from reasoning_gym.factory import DATASETS

        if dataset not in DATASETS:
            raise ValueError(f"unknown reasoning-gym dataset {dataset!r}; known: {sorted(DATASETS)}")
        config = dict(config or {})
        for key in ("seed", "size"):
            if key in config:
                raise ValueError(f"set {key} through train_/eval_{key}, not config")
        train_range = range(train_seed, train_seed + train_size)
        eval_range = range(eval_seed, eval_seed + eval_size)
        if train_range and eval_range and (train_range.start < eval_range.stop
                                           and eval_range.start < train_range.stop):
            raise ValueError(f"train seeds {train_range} and eval seeds {eval_range} overlap: "
                             "reasoning-gym item i uses seed+i, so the splits would share items")
        # Build once here so a bad config fails at construction, naming the dataset.
        _dataset(dataset, tuple(sorted(config.items())), eval_seed, max(eval_size, 1))
        self.dataset, self.config_items = dataset, tuple(sorted(config.items()))
        self._splits = {"train": (train_seed, train_size), "eval": (eval_seed, eval_size)}
        self.isolate, self.score_timeout_s = isolate, score_timeout_s
        self.max_answer_chars = max_answer_chars
        if system_prompt is not None:  # e.g. a short one, for tiny models on a CPU
            self.system_prompt = system_prompt
        self._workers = workers
        self._tasks = ReasoningGymTasks(self)
        self._task: Optional[Task] = None
        self._done = True

    def split_args(self, split: str) -> tuple[int, int]:
        return self._splits[split]

    def tasks(self) -> ReasoningGymTasks:
        return self._tasks

    def reset(self, task: Task) -> str:
        if "question" not in task.data:
            task = self._task_from_id(task.task_id)
        self._task, self._done = task, False
        return task.data["question"]

    def _task_from_id(self, task_id: str) -> Task:
        try:
            dataset, split, index = task_id.rsplit("/", 2)
            assert dataset == self.dataset and split in self._splits
            return self._tasks.get(split, int(index))
        except (ValueError, AssertionError, IndexError):
            raise ValueError(f"task {task_id!r} has no question in its data and is not an id "
                             f"like '{self.dataset}/eval/3'") from None

    def _entry(self) -> dict[str, Any]:
        d = self._task.data
        return {"question": d["question"], "answer": d.get("answer"), "metadata": d.get("metadata", {})}

    def _score(self, answer: str) -> float:
        split = self._task.data.get("split", "eval")
        seed, size = self._splits.get(split, self._splits["eval"])
        args = (self.dataset, self.config_items, seed, size, self._entry(), answer)
        if not self.isolate:
            return score_entry(*args)
        if self._workers is None:
            self._workers = shared_workers()
        # Building the dataset (and importing reasoning-gym) happens once per worker, outside
        # the scoring deadline.
        return self._workers.call(score_entry, *args, timeout_s=self.score_timeout_s,
                                  prepare=(_dataset, args[:4]))

    def step(self, action: str) -> StepResult:
        if self._task is None or self._done:
            return StepResult("The episode is over; call reset to start a new one.", 0.0, True,
                              {"invalid_action": True})
        self._done = True  # single turn: the reply is scored once, whatever it holds
        action = action if isinstance(action, str) else str(action)
        answer = extract_answer(action)
        info = {"format_ok": answer is not None, "success": False,
                "gold": self._task.data.get("answer")}
        if answer is None:
            return StepResult("No <answer>...</answer> found in the reply; scored 0.", 0.0, True, info)
        if len(answer) > self.max_answer_chars:
            return StepResult(f"The answer is {len(answer)} characters; the limit is "
                              f"{self.max_answer_chars}. Scored 0.", 0.0, True, info)
        try:
            score = self._score(answer)
        except (TimeoutError, WorkerError) as e:
            info["score_error"] = str(e)
            return StepResult("The answer could not be scored in time; scored 0.", 0.0, True, info)
        except Exception as e:  # noqa: BLE001 - an in-process scorer failing on odd input
            info["score_error"] = f"{type(e).__name__}: {e}"
            return StepResult("The scorer rejected the answer; scored 0.", 0.0, True, info)
        info["success"] = score >= 1.0
        verdict = "Correct." if score >= 1.0 else f"Not correct (score {score:.2f})."
        return StepResult(verdict, score, True, info)


def _signature_of_the_env(factory, fixed: tuple[str, ...] = ()):
    """Gives `factory` ReasoningGymEnv's signature less the `fixed` arguments it sets itself,
    so a config lists and types its real kwargs (rl_tpu.core.env.kwargs_of)."""
    params = inspect.signature(ReasoningGymEnv, eval_str=True).parameters.values()
    factory.__signature__ = inspect.Signature([p for p in params if p.name not in fixed])
    return factory


@register("reasoning_gym")
@_signature_of_the_env
def make_reasoning_gym(dataset: str, **kwargs) -> ReasoningGymEnv:
    """Any reasoning-gym dataset by name: `make("reasoning_gym", dataset="maze")`."""
    return ReasoningGymEnv(dataset=dataset, **kwargs)


@register("countdown")
@functools.partial(_signature_of_the_env, fixed=("dataset",))
def make_countdown(**kwargs) -> ReasoningGymEnv:
    env = ReasoningGymEnv(dataset="countdown", **kwargs)
    env.name = "countdown"
    return env


# Sentences the arithmetic teacher pads its replies with: true but useless, so a policy can
# drop them and lose nothing (the removable verbosity a SIRI compression phase should cut).
TEACHER_FILLER = ("Let me think about this.", "I will go step by step.",
                  "First I read the numbers.", "Then I add them up.",
                  "I check my work again.", "This is a simple sum.")


# `arithmetic`'s teachers: the sum in one line, or (for sums) a running total term by term
ARITHMETIC_TEACHERS = ("worked", "steps")


def arithmetic_teacher_reply(task: Task, rng: random.Random, skill: float,
                             max_filler: int = 3, teacher: str = "worked") -> str:
    """An imperfect, verbose teacher for `arithmetic`: 0..max_filler filler sentences, the
    expression worked out, then the answer tag. Right with probability `skill`; otherwise off
    by 1 or 2 (a slip in the sum, kept in the worked line so the reply is self-consistent).

    teacher="steps" works a sum of several terms as a scratchpad of running totals
    (`6 + 9 = 15. 15 + 8 = 23.`), whose length grows with the terms: the reasoning a tight
    generation budget cuts, unlike the filler. Its slip is in one step, carried on after."""
    answer = task.data["answer"]
    expression = task.data.get("metadata", {}).get("expression")
    wrong = rng.random() >= skill
    terms = expression.split(" + ") if expression else []
    if teacher == "steps" and len(terms) > 1 and all(t.strip().isdigit() for t in terms):
        filler = [rng.choice(TEACHER_FILLER) for _ in range(rng.randint(0, max_filler))]
        worked, total = [], int(terms[0])
        slip = rng.randrange(1, len(terms)) if wrong else -1
        for i, term in enumerate(terms[1:], 1):
            before, total = total, total + int(term)
            if i == slip:
                total += rng.choice((-2, -1, 1, 2))
            worked.append(f"{before} + {int(term)} = {total}.")
        return " ".join(filler + worked + [f"<answer>{total}</answer>"])
    if wrong:  # drawn before the filler, as this teacher always has: same seed, same demos
        try:
            answer = str(int(answer) + rng.choice((-2, -1, 1, 2)))
        except ValueError:  # a non-integer answer (division): slip by appending a digit
            answer = answer + "1"
    filler = [rng.choice(TEACHER_FILLER) for _ in range(rng.randint(0, max_filler))]
    worked = [f"{expression} = {answer}."] if expression else []
    return " ".join(filler + worked + [f"<answer>{answer}</answer>"])


class ArithmeticEnv(ReasoningGymEnv):
    """reasoning-gym's basic_arithmetic with a teacher for SFT demonstrations (an SFT warm
    start needs `teacher_reply`; `teacher` picks its style, ARITHMETIC_TEACHERS); scoring is
    the dataset's own, as every reasoning env."""

    def __init__(self, teacher: str = "worked", **kwargs):
        if teacher not in ARITHMETIC_TEACHERS:
            raise ValueError(f"arithmetic: teacher={teacher!r}; choose one of "
                             f"{ARITHMETIC_TEACHERS}")
        super().__init__(**kwargs)
        self.teacher = teacher

    def teacher_reply(self, task: Task, rng: random.Random, skill: float) -> str:
        return arithmetic_teacher_reply(task, rng, skill, teacher=self.teacher)


@register("arithmetic")
def make_arithmetic(teacher: str = "worked", **kwargs) -> ReasoningGymEnv:
    env = ArithmeticEnv(teacher=teacher, dataset="basic_arithmetic", **kwargs)
    env.name = "arithmetic"
    return env


# ReasoningGymEnv's keyword arguments less `dataset`, and the teacher's style
make_arithmetic.__signature__ = inspect.Signature(
    [inspect.Parameter("teacher", inspect.Parameter.KEYWORD_ONLY, default="worked",
                       annotation=str)]
    + [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in
       inspect.signature(ReasoningGymEnv, eval_str=True).parameters.values()
       if p.name != "dataset"])
