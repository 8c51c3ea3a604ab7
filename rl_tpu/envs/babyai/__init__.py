"""BabyAI: minigrid's grid-world levels as a text environment, one env ("babyai").

Default: AgentGym's BabyAI (its listed macro actions, observations, running score and data_idx
task numbering), so results compare with AgentGym-RL's; `actions="primitive"` is rl_tpu's own
text BabyAI (seven primitive actions, a sentence rendering of the view, minigrid's reward).
  env.py        the env, both modes, and the BabyAIBot demonstrations of the primitive mode
  levels.py     the 40 levels in AgentGym's order, data_idx -> (level, seed), the task source
  primitive.py  the primitive mode's action words, parsing, rendering and feedback
"""

from rl_tpu.envs.babyai.env import (ACK, COMPLETED, INSTRUCTION, MAX_TURNS, NO_CHANGE,
                                    NOT_RECOGNIZED, BabyAIEnv, demonstrate, expert_actions)
from rl_tpu.envs.babyai.levels import (LEVELS, PRIMITIVE_LEVELS, BabyAITasks, data_idx_of,
                                       level_and_seed)
from rl_tpu.envs.babyai.primitive import ACTIONS, parse_primitive

__all__ = ["ACK", "ACTIONS", "COMPLETED", "INSTRUCTION", "LEVELS", "MAX_TURNS", "NO_CHANGE",
           "NOT_RECOGNIZED", "PRIMITIVE_LEVELS", "BabyAIEnv", "BabyAITasks", "data_idx_of",
           "demonstrate", "expert_actions", "level_and_seed", "parse_primitive"]
