"""A tiny byte-level BPE chat tokenizer, built locally for tests and smoke runs.

Tests must never reach a hub, yet much of the stack (chat templates, multi-turn token
histories, HF export, the rollout server) needs a *real* `transformers` tokenizer with a real
chat template. `build_tokenizer` trains one in well under a second with the `tokenizers`
library on a small corpus generated here, so the result is the same on every machine.

The tokenizer mirrors the Qwen2 / ChatML conventions the rest of rl_tpu is written for:

- byte-level BPE (GPT-2 style pre-tokenisation), so any unicode text round-trips exactly;
- special tokens `<|endoftext|>` (pad; there is no bos), `<|im_start|>` and `<|im_end|>`
  (eos, the token that ends every assistant turn);
- a ChatML chat template: each message renders as
  `<|im_start|>{role}\\n{content}<|im_end|>\\n`, and `add_generation_prompt` appends
  `<|im_start|>assistant\\n`.

The total vocabulary (special tokens included) is exactly `vocab_size`, because a tiny model's
embedding table is built with that many rows and every id the tokenizer can emit must fit.
The built-in corpus supports about 1,650 ids of real merges; above that the rest of the id
space is filled with `<|reserved_{i}|>` special tokens (as Llama 3 does), which text never
encodes to.

Example:
    tok = build_tokenizer(512)
    tok.save_pretrained(model_dir)   # AutoTokenizer.from_pretrained(model_dir) reloads it
"""

from __future__ import annotations

import random
from typing import Sequence

import tokenizers
import transformers
from tokenizers import decoders, models, pre_tokenizers, trainers

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Order fixes the ids: <|endoftext|>=0, <|im_start|>=1, <|im_end|>=2.
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

# 256 byte symbols + 3 special tokens is the floor; demand some merges on top so the
# tokenizer actually compresses text (and so sequence lengths in tests look like real ones).
MIN_VOCAB_SIZE = 300

CHATML_TEMPLATE = (
    # Tools (function calling, docs/tools.md): with `tools=` the schemas open the conversation
    # in a system turn (after the caller's own system text, if any), and the model calls one by
    # writing a JSON object {"name", "arguments"} between <tool_call> tags, the convention of
    # Qwen2.5's templates, which rl_tpu.tools.calls reads from this text. Without tools the
    # template is plain ChatML. An assistant message given as structured `tool_calls` (as
    # OpenAI clients send them back, arguments as a JSON string or an object) renders each in
    # that form; a None content renders empty.
    "{% set ns = namespace(start=0) %}"
    "{% if tools %}"
    "{{ '<|im_start|>system\\n' }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{{ messages[0]['content'] + '\\n\\n' }}{% set ns.start = 1 %}{% endif %}"
    "{{ 'You can call these tools (JSON schemas):\\n' }}"
    "{% for tool in tools %}{{ tool | tojson }}{{ '\\n' }}{% endfor %}"
    "{{ 'To call one, reply with <tool_call>{\\\"name\\\": ..., \\\"arguments\\\": {...}}</tool_call>.' }}"
    "{{ '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% for message in messages[ns.start:] %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') }}"
    "{% for call in message.get('tool_calls') or [] %}"
    "{% set f = call['function'] if 'function' in call else call %}"
    "{{ '<tool_call>{\\\"name\\\": ' + f['name'] | tojson + ', \\\"arguments\\\": ' }}"
    "{{ f['arguments'] if f['arguments'] is string else f['arguments'] | tojson }}"
    "{{ '}</tool_call>' }}{% endfor %}"
    "{{ '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# --- corpus -------------------------------------------------------------------------------
# Word lists for a few kinds of text the smoke tasks use: plain English, arithmetic, code and
# chat-like answers. Only their statistics matter (they decide which merges BPE learns).

_SUBJECTS = ["the agent", "a model", "the robot", "my friend", "the teacher", "each player",
             "the policy", "a student", "the server", "our team", "the user", "she", "he", "they"]
_VERBS = ["moves", "takes", "finds", "counts", "opens", "reads", "writes", "solves", "checks",
          "returns", "picks", "drops", "learns", "answers", "computes", "explains"]
_OBJECTS = ["the red box", "a key", "the door", "two apples", "the answer", "a number",
            "the next step", "the final result", "a small table", "the green ball",
            "the word list", "the reward", "three coins", "the blue room", "a short story"]
_ENDINGS = ["quickly", "again", "in the kitchen", "after that", "before noon", "with care",
            "for the first time", "and then stops", "because it is late", "without help"]
_QUESTIONS = ["What is", "How many", "Can you", "Why does", "Where is", "Which one", "Please"]
_MATH_WORDS = ["sum", "product", "difference", "answer", "total", "remainder", "square", "root"]
_CODE_LINES = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i)\n",
    "if x > 0:\n    y = x * 2\nelse:\n    y = -x\n",
    "import numpy as np\nx = np.zeros((3, 4))\n",
    "while n != 1:\n    n = n // 2 if n % 2 == 0 else 3 * n + 1\n",
    "result = [v for v in values if v is not None]\n",
    "class Env:\n    def step(self, action):\n        return obs, reward, done\n",
    '{"action": "move", "direction": "north", "steps": 3}\n',
]
# Common words, so larger vocabularies still learn merges that look like real English.
_WORDS = """
about above across after against along always among another answer around because become
before behind below between both bring build came carry change check child city close come
could count cover cross different does done down during each early earth easy enough even
every example face fact family far father feel field figure find first follow food form found
four friend from full game give good great green ground group grow half hand happen hard have
head hear help here high hold home house idea important inside into just keep kind know land
large last late learn leave letter life light line list little live long look made make many
mark matter mean measure might mind money more morning most mother move much must name near
need never next night nothing notice number often only open order other over page paper part
pass people picture place plan plant play point power problem question quick rain reach read
ready real reason record remember rest right river road rock room round rule same school
second seem sentence several shape short should show side simple since size small sound
space special stand start state step still stood story strong study such sure system table
take talk tell than that their them then there these thing think those thought three through
time today together toward tree true turn under until upon usual very voice walk want warm
watch water week well were what when where which while white whole why will wind with within
without word work world would write year young zero seven eight nine eleven twelve hundred
thousand million vector matrix function variable integer value equal greater less prime
""".split()


def _sentence(rng: random.Random) -> str:
    s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_ENDINGS)}."
    return s[0].upper() + s[1:]


def _maths(rng: random.Random) -> str:
    a, b = rng.randint(0, 999), rng.randint(1, 99)
    op, value = rng.choice([("+", a + b), ("-", a - b), ("*", a * b), ("/", round(a / b, 2))])
    word = rng.choice(_MATH_WORDS)
    return f"{rng.choice(_QUESTIONS)} {a} {op} {b}? The {word} is {value}. So the answer is \\boxed{{{value}}}."


def _corpus(num_lines: int = 2000, seed: int = 0) -> list[str]:
    """A deterministic mix of English, arithmetic and code lines (about 150 KB)."""
    rng = random.Random(seed)
    lines = []
    for i in range(num_lines):
        kind = i % 5
        if kind == 4:
            words = rng.choices(_WORDS, k=rng.randint(6, 16))
            lines.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ","]))
        elif kind == 0:
            lines.append(_sentence(rng) + " " + _sentence(rng))
        elif kind == 1:
            lines.append(_maths(rng))
        elif kind == 2:
            lines.append(rng.choice(_CODE_LINES))
        else:
            # Chat-like answers, so role names and the words around turns get merges.
            lines.append(f"user\n{rng.choice(_QUESTIONS)} {rng.choice(_OBJECTS)}?\n"
                         f"assistant\nI think {_sentence(rng).lower()}\nsystem\nYou are a helpful assistant.")
    return lines


# --- builder ------------------------------------------------------------------------------


def build_tokenizer(vocab_size: int = 512, extra_texts: Sequence[str] = ()
                    ) -> transformers.PreTrainedTokenizerFast:
    """Train a byte-level BPE ChatML tokenizer whose full vocabulary is exactly `vocab_size`.

    Args:
      vocab_size: number of ids, special tokens included (= the tiny model's embedding rows).
      extra_texts: more corpus lines, e.g. an env's own observations, so its words get merges
        the way a real tokenizer's English does (a 1 KB BabyAI observation is ~550 ids with
        the built-in corpus alone). Deterministic in (vocab_size, extra_texts).

    Returns:
      A `transformers` fast tokenizer with eos `<|im_end|>`, pad `<|endoftext|>`, no bos, and a
      ChatML `chat_template`. The result is deterministic in `vocab_size`.

    Raises:
      ValueError: if `vocab_size` is below `MIN_VOCAB_SIZE`.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size={vocab_size} is too small for a byte-level tokenizer: it needs 256 byte "
            f"symbols + {len(SPECIAL_TOKENS)} special tokens + some merges; use at least "
            f"{MIN_VOCAB_SIZE}.")

    tok = tokenizers.Tokenizer(models.BPE())
    # add_prefix_space=False: "Hello" and " Hello" stay different tokens, as in Qwen2/GPT-2, and
    # encode(a) + encode(b) == encode(a + b) at whitespace boundaries, which chat histories need.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        # All 256 byte symbols, even ones the corpus never uses: that is what makes every
        # string encodable (no unk token exists).
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(_corpus() + list(extra_texts), trainer=trainer)

    # The corpus may run out of pairs worth merging before reaching a large vocab_size. Pad with
    # reserved special tokens (as Llama 3 does) so the id space is still exactly vocab_size.
    shortfall = vocab_size - tok.get_vocab_size(with_added_tokens=True)
    if shortfall > 0:
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(shortfall)])
    got = tok.get_vocab_size(with_added_tokens=True)
    if got != vocab_size:  # Would mean the trainer overshot: a bug here, not a user error.
        raise RuntimeError(f"built a tokenizer with {got} ids, wanted exactly {vocab_size}")

    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=None,
        chat_template=CHATML_TEMPLATE,
        # Same as Qwen2: ids decode to exactly the bytes they encode, no space "clean-up".
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
    )
