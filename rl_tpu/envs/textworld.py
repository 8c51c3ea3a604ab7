"""TextWorld: procedurally generated text adventures, made offline with the `textworld` package.

Each task is one game, generated from a seed by `textworld.generator.make_game` (rooms,
objects, a quest of a given length) and compiled to a Z-machine file with the Inform 7
compiler that ships inside the package. Games are cached on disk (`cache_dir`, default
`~/.cache/rl_tpu/textworld`, or `$RL_TPU_TEXTWORLD_CACHE`), under a folder named by the
generation options and the textworld version, so a seed always means the same game and a
second run skips the ~1 s compile.

Reward is the game score's increase divided by the maximum score (an episode's rewards sum
to at most 1); success is winning. The demonstration is the game's walkthrough, which
textworld derives from the quest it generated (`demonstration(task)`).

Input hygiene: the Z-machine interpreter hangs on a NUL byte, crashes on long non-ASCII
input, and obeys meta commands (quit, restart, restore, script, ...) that would end or rewind
the episode behind the env's back. Such actions never reach the game: they come back as
invalid-action observations.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Optional

from rl_tpu.core.env import (Env, StepResult, Task, TaskSource, invalid_action, out_of_steps,
                              register)
from rl_tpu.optional import require

SYSTEM_PROMPT = """You play a text adventure. Each turn, reply with one short command in plain
English, such as:
  look | inventory | examine <thing> | go north/south/east/west
  take <thing> [from <container or supporter>] | drop <thing>
  put <thing> on <supporter> | insert <thing> into <container>
  open <thing> | close <thing> | unlock <door or container> with <key> | lock ... with <key>
  eat <food>
Use object names exactly as the game writes them. Follow the goal stated at the start."""

EVAL_SEED_BASE = 1_000_000  # eval game i has seed EVAL_SEED_BASE + i; train game i has seed i
MAX_COMMAND_CHARS = 190  # jericho truncates commands past 198 bytes (with a warning)

# Interpreter and parser commands that talk to the game system rather than the game world.
_META_VERBS = frozenset("quit q restart restore save undo oops script unscript transcript "
                        "version verbose brief superbrief notify pronouns again g".split())
_STATUS_TAIL = re.compile(r"\n\s*>[^\n]*\Z")  # the prompt line with its status bar
_END_PROMPT = re.compile(r"\n*Would you like to RESTART, RESTORE a saved game, QUIT or UNDO.*",
                         re.DOTALL)


def default_cache_dir() -> Path:
    return Path(os.environ.get("RL_TPU_TEXTWORLD_CACHE",
                               Path.home() / ".cache" / "rl_tpu" / "textworld"))


def _import_textworld():
    textworld = require("textworld", extra="envs", needed_by="the textworld env")
    require("textworld.generator", extra="envs", needed_by="the textworld env")
    return textworld


def clean_feedback(text: str) -> str:
    """Game text without the trailing '>' prompt, status bar and end-of-game menu."""
    text = _END_PROMPT.sub("", text)
    text = _STATUS_TAIL.sub("", text)
    return text.strip()


def check_command(action: str) -> Optional[str]:
    """Why `action` may not be sent to the game, or None when it may."""
    if not action:
        return "the command is empty; reply with a command such as 'look' or 'go north'"
    if len(action) > MAX_COMMAND_CHARS:
        return f"the command is {len(action)} characters; keep it under {MAX_COMMAND_CHARS}"
    if "\n" in action or "\r" in action:
        return "one command per turn, on a single line"
    if any(not (" " <= ch <= "~") for ch in action):
        return "use plain ASCII letters, digits and punctuation only (no control or non-ASCII characters)"
    verb = action.split()[0].lower().rstrip(".!")
    if verb in _META_VERBS:
        return f"'{verb}' is a game-system command, not an action in the world"
    return None


class TextWorldTasks(TaskSource):
    """Train: seeds 0, 1, 2, ... (unbounded); eval: seeds EVAL_SEED_BASE + i, i < eval_size."""

    def __init__(self, env: "TextWorldEnv"):
        self._env = env

    def size(self, split: str) -> Optional[int]:
        self.check_split(split)
        return None if split == "train" else self._env.eval_size

    def get(self, split: str, index: int) -> Task:
        self.check_split(split)
        if index < 0 or (split == "train" and index >= EVAL_SEED_BASE) or (
                split == "eval" and index >= self._env.eval_size):
            raise IndexError(f"no {split} task {index}")
        seed = index if split == "train" else EVAL_SEED_BASE + index
        return Task(task_id=f"{self._env.game_key}/seed{seed}", data={"seed": seed, "split": split})


@register("textworld")
class TextWorldEnv(Env):
    """One generated TextWorld game per episode."""

    name = "textworld"
    system_prompt = SYSTEM_PROMPT

    def __init__(self, nb_rooms: int = 5, nb_objects: int = 10, quest_length: int = 5,
                 eval_size: int = 100, max_steps: Optional[int] = 100,
                 cache_dir: Optional[str] = None, show_admissible: bool = False):
        textworld = _import_textworld()
        if nb_rooms < 1 or nb_objects < 0 or quest_length < 1:
            raise ValueError("need nb_rooms >= 1, nb_objects >= 0 and quest_length >= 1")
        self.nb_rooms, self.nb_objects, self.quest_length = nb_rooms, nb_objects, quest_length
        self.eval_size, self.max_steps, self.show_admissible = eval_size, max_steps, show_admissible
        self.game_key = f"r{nb_rooms}-o{nb_objects}-q{quest_length}"
        # The textworld version is in the path: another version may generate other games.
        self.cache_dir = Path(cache_dir or default_cache_dir()) / f"tw{textworld.__version__}" / self.game_key
        # Only what is used: admissible commands cost a pass over the game state every step.
        self._infos = textworld.EnvInfos(objective=True, description=True, score=True,
                                         max_score=True, won=True, lost=True, moves=True,
                                         admissible_commands=show_admissible)
        self._tasks = TextWorldTasks(self)
        self._game = None  # textworld env of the current episode
        self._game_path: Optional[Path] = None
        self._score, self._max_score, self._steps, self._done = 0, 1, 0, True

    def tasks(self) -> TextWorldTasks:
        return self._tasks

    # -- game files ---------------------------------------------------------------------------

    def game_file(self, seed: int) -> Path:
        """The compiled game for `seed`, generating and caching it on first use."""
        path = self.cache_dir / f"seed{seed}.z8"
        if path.exists() and path.with_suffix(".json").exists():
            return path
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        # Compile in a private folder, then move into place: parallel workers asking for the
        # same game never see a half-written file (os.replace is atomic).
        with tempfile.TemporaryDirectory(dir=self.cache_dir, prefix=".gen-") as tmp:
            built = self._generate(seed, Path(tmp))
            os.replace(built.with_suffix(".json"), path.with_suffix(".json"))
            os.replace(built, path)
        return path

    def _generate(self, seed: int, out_dir: Path) -> Path:
        textworld = _import_textworld()
        from textworld.generator import compile_game, make_game

        last_error = None
        # Rarely a seed admits no quest of the asked length; later attempts use derived seeds,
        # still a pure function of `seed`, so the task stays reproducible.
        for attempt in range(10):
            options = textworld.GameOptions()
            options.seeds = seed if attempt == 0 else seed * 1009 + attempt
            options.nb_rooms, options.nb_objects = self.nb_rooms, self.nb_objects
            options.quest_length = self.quest_length
            options.path = str(out_dir / f"seed{seed}.z8")
            options.force_recompile = True
            try:
                game = make_game(options)
            except Exception as e:  # noqa: BLE001 - QuestGenerationError and kin: next seed
                last_error = e
                continue
            return Path(compile_game(game, options))
        raise RuntimeError(f"textworld could not generate a game for seed {seed} with "
                           f"{self.game_key}: {last_error}")

    def demonstration(self, task: Task) -> list[str]:
        """The game's walkthrough: commands that win it from the start (the current episode is
        left as it is)."""
        textworld = _import_textworld()
        game = textworld.Game.load(str(self.game_file(self._seed(task)).with_suffix(".json")))
        return list(game.metadata.get("walkthrough") or game.walkthrough or [])

    def _seed(self, task: Task) -> int:
        # Ids name the generation options: a task of another configuration would silently
        # become a different game here.
        if "/" in task.task_id and not task.task_id.startswith(self.game_key + "/"):
            raise ValueError(f"textworld task {task.task_id!r} is for other game options than "
                             f"this env's {self.game_key!r}")
        if "seed" in task.data:
            return int(task.data["seed"])
        m = re.search(r"seed(\d+)$", task.task_id)
        if not m:
            raise ValueError(f"textworld task {task.task_id!r} has no seed in data or id")
        return int(m.group(1))

    # -- episode ------------------------------------------------------------------------------

    def reset(self, task: Task) -> str:
        textworld = _import_textworld()
        path = self.game_file(self._seed(task))
        if self._game is None or self._game_path != path:
            self.close()
            with warnings.catch_warnings():
                # jericho says it cannot track score in TextWorld games; textworld's own
                # wrapper tracks it (state["score"]), so the warning is noise on every game.
                warnings.filterwarnings("ignore", message=".*is not fully supported.*")
                self._game = textworld.start(str(path), request_infos=self._infos)
            self._game_path = path
        state = self._game.reset()
        self._score, self._max_score = state["score"] or 0, max(1, state["max_score"] or 1)
        self._steps, self._done = 0, False
        # The objective plus the room, rather than the raw intro: that begins with ASCII art.
        return self._observe(f"{state['objective']}\n\n{state['description']}".strip(), state)

    def _observe(self, text: str, state) -> str:
        if self.show_admissible and not self._done:
            text += "\n\nAvailable commands: " + ", ".join(state["admissible_commands"] or [])
        return text

    def step(self, action: str) -> StepResult:
        if self._game is None or self._done:
            return StepResult("The episode is over; call reset to start a new one.", 0.0, True,
                              {"invalid_action": True})
        action = (action if isinstance(action, str) else str(action)).strip()
        problem = check_command(action)
        self._steps += 1
        if problem is not None:
            result = invalid_action(problem)
        else:
            state, _, game_done = self._game.step(action)
            score = state["score"] or 0
            reward = (score - self._score) / self._max_score
            self._score = score
            won, lost = bool(state["won"]), bool(state["lost"])
            self._done = game_done or won or lost
            result = StepResult(self._observe(clean_feedback(state.feedback), state), reward,
                                self._done, {"success": won, "won": won, "lost": lost,
                                             "score": score, "max_score": self._max_score})
        if not self._done and self.max_steps is not None and self._steps >= self.max_steps:
            self._done = True
            result = out_of_steps(result, self.max_steps)
        return result

    def close(self) -> None:
        if self._game is not None:
            try:
                self._game.close()
            finally:
                self._game, self._game_path, self._done = None, None, True

    def clear_cache(self) -> None:
        """Deletes this configuration's generated games."""
        shutil.rmtree(self.cache_dir, ignore_errors=True)
