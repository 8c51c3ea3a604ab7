"""A real pretrained model in and out: SmolLM2-135M-Instruct, converted from its GGUF on PyPI by
`launch.get_model`'s code, against transformers on the same files.

What is checked, and the tolerance each comparison holds (fp32; the numbers measured here are in
docs/models.md):
- the conversion equals transformers' own GGUF loader tensor for tensor, exactly (both
  dequantise the same Q4_1 blocks to fp32 and undo llama.cpp's q/k row order);
- logits equal transformers' on 16 prompts of 8 to 512 tokens within LOGIT_ATOL;
- the tokenizer and the chat template are token-exact against transformers' (its
  apply_chat_template, and its own GGUF tokenizer) on multi-turn chats;
- greedy replies equal transformers' generate for 32 prompts x 64 tokens, stopping at
  <|im_end|>; where they part, it is at a near-tie of the top two logits (NEAR_TIE);
- sampled log-probs equal the learner's `token_logprobs` within 1e-4.

The model is fetched once per machine (tests/real_model.py); every fixture here is
module-scoped, so each program compiles once.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest

from real_model import smollm2_dir
from rl_tpu.core.engine import GenerateRequest, SamplingParams
from rl_tpu.models import hf
from rl_tpu.models.logprobs import token_logprobs
from rl_tpu.models.tokenizer import load_tokenizer
from rl_tpu.models.transformer import Transformer
from rl_tpu.rollout.sampler import JaxSampler

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("real_model")]

IM_END = 2
# fp32 on both sides, 30 layers: logits of magnitude ~10-30 agree to ~1e-4 (accumulation order
# differs between XLA's and PyTorch's matmuls); LOGIT_ATOL leaves a 10x margin over the measured
# worst case, and is 1e-5 of the logits' spread.
LOGIT_ATOL = 2e-3
# Greedy decoding may part where the top two logits are within float noise of each other.
NEAR_TIE = 1e-3

QUESTIONS = [
    "What is 17 + 25?", "Tom has 3 apples and buys 4 more. How many apples does he have?",
    "Name three primary colours.", "Write a haiku about the sea.",
    "What is the capital of France?", "Explain what a prime number is in one sentence.",
    "Translate 'good morning' into Spanish.", "What is 12 times 11?",
    "Give me a synonym for 'happy'.", "How many legs does a spider have?",
    "Write a Python function that adds two numbers.", "What colour is the sky on a clear day?",
    "List the days of the week.", "What is the boiling point of water in Celsius?",
    "Who wrote Romeo and Juliet?", "Summarise the plot of Cinderella in two sentences.",
    "What is 100 divided by 4?", "Suggest a name for a pet goldfish.",
    "What does CPU stand for?", "Is a tomato a fruit or a vegetable?",
    "How many minutes are in two hours?", "What is the opposite of 'cold'?",
    "Describe a cat in five words.", "What is the square root of 81?",
    "Why do leaves change colour in autumn?", "Spell 'necessary' backwards.",
    "What is 9 minus 15?", "Recommend a book for a ten-year-old.",
    "What gas do plants take in from the air?", "Count from 1 to 10.",
    "What is the largest planet in the solar system?", "Finish the sentence: The early bird...",
]
LONG_TEXT = (
    "The river wound through the valley, past farms and a mill whose wheel had not turned in "
    "years. In 1887 the town council voted 7 to 2 to build a bridge; it cost $12,450. "
    "def area(r):\n    return 3.14159 * r ** 2\n"
    "Children learn that 3 x 4 = 12 and that the Earth orbits the Sun every 365.25 days. "
    "Café owners in Zürich sell crème brûlée; naïve résumés list 日本語 and emoji 🙂. ")


@pytest.fixture(scope="module")
def model_dir():
    return smollm2_dir()


@pytest.fixture(scope="module")
def tok(model_dir):
    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def torch_model(model_dir):
    # one thread: pytest runs two workers on two cores, and torch's default pool of all cores
    # spin-waits against the other worker (transformers' generate here took 6x longer)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def ours(model_dir):
    # scanned layers, as the trainer runs them: one layer to compile, not 30 (the sampler
    # unstacks them into its own copy)
    cfg, params = hf.load(model_dir, dtype="float32", scan_layers=True)
    forward = jax.jit(lambda p, x: Transformer(cfg).apply({"params": p}, x))
    return cfg, params, forward


def chat(tok, question):
    return tok.apply_chat_template([{"role": "user", "content": question}],
                                   add_generation_prompt=True)


# ----------------------------------------------------------------------------- the files


def test_the_directory_is_the_instruct_model_with_its_template_and_end_of_turn(model_dir, tok):
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["intermediate_size"],
            config["vocab_size"]) == (30, 576, 9, 3, 1536, 49152)
    assert config["tie_word_embeddings"] and config["rope_theta"] == 1e5
    assert config["rms_norm_eps"] == 1e-5 and config["max_position_embeddings"] == 8192
    with open(os.path.join(model_dir, "generation_config.json")) as f:
        assert json.load(f)["eos_token_id"] == IM_END
    assert tok.decode([IM_END]) == "<|im_end|>" and tok.eos_token_id == IM_END
    assert hf.read_config(model_dir).eos_token_ids == (IM_END,)
    assert tok.render([{"role": "user", "content": "hi"}], add_generation_prompt=True) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_conversion_equals_transformers_own_gguf_loader_exactly(model_dir):
    from safetensors.numpy import load_file

    from rl_tpu.models import sources

    gguf_path = sources.fetch_gguf("smollm2-135m-instruct")
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path), dtype=torch.float32)
    theirs = reference.state_dict()
    ours = load_file(os.path.join(model_dir, "model.safetensors"))
    # their state dict lists the tied head under its own name too
    assert set(ours) == set(theirs) - {"lm_head.weight"}
    for name, value in ours.items():
        np.testing.assert_array_equal(value, theirs[name].numpy(), err_msg=name)


# ----------------------------------------------------------------------------- tokenizer


CHATS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "You answer in French."},
     {"role": "user", "content": "Hello there!"},
     {"role": "assistant", "content": "Bonjour !"},
     {"role": "user", "content": "How are you?\nTell me  twice."}],
    [{"role": "user", "content": "Write code:\n```py\nprint('x')\n```"},
     {"role": "assistant", "content": "Done: 日本語 🙂 crème"},
     {"role": "user", "content": "<|im_start|> is a token; 3.14159, $12,450."},
     {"role": "assistant", "content": ""}, {"role": "user", "content": "   spaces   "}],
]


@pytest.mark.parametrize("chat_index", range(len(CHATS)))
@pytest.mark.parametrize("generation_prompt", [False, True])
def test_chat_template_is_token_exact_against_transformers(tok, model_dir, chat_index,
                                                           generation_prompt):
    reference = transformers.AutoTokenizer.from_pretrained(model_dir)
    messages = CHATS[chat_index]
    theirs = reference.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                           tokenize=True, return_dict=False)
    assert tok.apply_chat_template(messages, add_generation_prompt=generation_prompt) == list(
        theirs)
    # the token-exact history a multi-turn episode builds, one message at a time
    history = tok.apply_chat_template(messages[:1], add_generation_prompt=False)
    for at in range(1, len(messages)):
        history = tok.append_message(history, messages[:at], messages[at],
                                     add_generation_prompt=False)
    assert history == tok.apply_chat_template(messages)


def test_tokenizer_equals_transformers_own_gguf_tokenizer(tok):
    from rl_tpu.models import sources

    gguf_path = sources.fetch_gguf("smollm2-135m-instruct")
    reference = transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
    for text in [LONG_TEXT, *QUESTIONS, "  leading and trailing  ", "\n\n\t", "a" * 300,
                 "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>"]:
        assert tok.encode(text) == reference.encode(text, add_special_tokens=False), text
        ids = tok.encode(text)
        assert tok.decode(ids) == reference.decode(ids, clean_up_tokenization_spaces=False)


# ----------------------------------------------------------------------------- logits


def long_prompts(tok, lengths):
    body = tok.apply_chat_template([{"role": "user", "content": LONG_TEXT * 12}])
    assert len(body) >= max(lengths)
    return [body[k:k + n] for k, n in enumerate(lengths)]  # 16 different windows


LENGTHS = [8, 11, 16, 23, 32, 45, 64, 91, 128, 181, 256, 300, 362, 420, 480, 512]


def test_logits_equal_transformers_fp32_on_prompts_of_8_to_512_tokens(tok, torch_model, ours):
    cfg, params, forward = ours
    prompts = long_prompts(tok, LENGTHS)
    worst, spread = 0.0, 0.0
    # three shapes (<= 64, <= 256, <= 512 tokens) rather than 16 rows of 512: half the compute
    for group in (prompts[:7], prompts[7:11], prompts[11:]):
        batch = np.full((len(group), max(map(len, group))), IM_END, np.int32)
        for row, ids in enumerate(group):  # right padding: causal, so never seen by the rows
            batch[row, :len(ids)] = ids
        ours_logits = np.asarray(forward(params, batch))
        with torch.no_grad():
            theirs = torch_model(torch.from_numpy(batch).long()).logits.numpy()
        for row, ids in enumerate(group):
            a, b = ours_logits[row, :len(ids)], theirs[row, :len(ids)]
            worst = max(worst, float(np.abs(a - b).max()))
            spread = max(spread, float(b.max() - b.min()))
            np.testing.assert_array_equal(a.argmax(-1), b.argmax(-1))
    print(f"fp32 logits: max |ours - transformers| = {worst:.2e} (logit range {spread:.1f})")
    assert worst < LOGIT_ATOL


def test_bf16_logits_stay_near_fp32(tok, model_dir, torch_model):
    """bf16 params and compute (the TPU default) against transformers' fp32: reported, and
    held to what bf16's 8-bit mantissa allows over 30 layers."""
    cfg, params = hf.load(model_dir, dtype="bfloat16", scan_layers=True)
    prompts = long_prompts(tok, [128] * 4)
    logits = np.asarray(jax.jit(lambda p, x: Transformer(cfg).apply({"params": p}, x))(
        params, np.array(prompts, np.int32)), np.float32)
    with torch.no_grad():
        theirs = torch_model(torch.tensor(prompts)).logits.numpy()
    gap = np.abs(logits - theirs)
    agree = float((logits.argmax(-1) == theirs.argmax(-1)).mean())
    print(f"bf16 logits vs fp32: mean |delta| {gap.mean():.3f}, max {gap.max():.2f}, "
          f"top-1 agreement {agree:.3f}")
    assert gap.mean() < 0.5 and agree > 0.9


# ----------------------------------------------------------------------------- decoding


@pytest.fixture(scope="module")
def sampler(ours, tok):
    cfg, params, _ = ours
    return JaxSampler(cfg, params, tokenizer=tok, max_batch=32)


@pytest.fixture(scope="module")
def prompts(tok):
    return [chat(tok, q) for q in QUESTIONS]


@pytest.fixture(scope="module")
def greedy_results(sampler, prompts):
    """32 prompts x up to 64 tokens, greedy: one batch, so one compiled prefill and decode
    (the sampled test below draws in the same shapes, with the same programs)."""
    greedy = SamplingParams(max_new_tokens=64, temperature=0.0)
    return sampler.generate([GenerateRequest(p, greedy) for p in prompts])


def transformers_greedy(torch_model, prompts, max_new_tokens):
    """transformers' greedy replies, left-padded in one batch, cut after <|im_end|>."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[IM_END] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = torch_model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                   max_new_tokens=max_new_tokens, eos_token_id=IM_END,
                                   pad_token_id=IM_END)
    replies = []
    for row in out[:, width:].tolist():
        replies.append(row[:row.index(IM_END) + 1] if IM_END in row else row)
    return replies


def test_greedy_replies_equal_transformers_and_stop_at_im_end(tok, torch_model, ours, prompts,
                                                               greedy_results):
    cfg, params, forward = ours
    results = greedy_results
    theirs = transformers_greedy(torch_model, prompts, 64)
    same = 0
    for prompt, result, reference in zip(prompts, results, theirs):
        mine = list(result.output_ids)
        stopped = bool(mine) and mine[-1] == IM_END
        assert result.finish_reason == ("stop" if stopped else "length")
        assert IM_END not in mine[:-1]  # nothing decoded past the end of the turn
        if mine == reference:
            same += 1
            continue
        # where they part, the two candidates must be a near-tie under our own logits
        at = next(i for i, (a, b) in enumerate(zip(mine, reference)) if a != b)
        logits = np.asarray(forward(params, np.array([prompt + mine[:at]], np.int32)))[0, -1]
        margin = abs(float(logits[mine[at]] - logits[reference[at]]))
        assert margin < NEAR_TIE, (tok.decode(prompt[-12:]), at, margin)
    print(f"greedy: {same}/{len(prompts)} replies identical to transformers'")
    assert same >= len(prompts) - 2


def test_the_issues_answers_are_reproduced(tok, greedy_results):
    sum_reply, apples_reply = greedy_results[:2]  # QUESTIONS[:2]
    assert tok.decode(sum_reply.output_ids) == "17 + 25 = 32.<|im_end|>"
    assert sum_reply.finish_reason == "stop"
    text = tok.decode(apples_reply.output_ids)
    assert "3 + 4 = 7" in text and text.endswith("<|im_end|>")


def test_sampled_logprobs_equal_the_learners_within_1e4(ours, sampler, prompts):
    cfg, params, _ = ours
    sampling = SamplingParams(max_new_tokens=64, temperature=1.0, seed=3)
    # all 32 rows sample (the compiled shapes of the greedy batch); 8 are scored again
    results = sampler.generate([GenerateRequest(p, sampling) for p in prompts])[:8]
    prompts = prompts[:8]
    rows = [p + list(r.output_ids) for p, r in zip(prompts, results)]
    width = max(len(r) for r in rows)
    tokens = np.full((len(rows), width), IM_END, np.int32)
    for i, row in enumerate(rows):
        tokens[i, :len(row)] = row
    learner, _ = jax.jit(lambda p, t: token_logprobs(Transformer(cfg), p, {"tokens": t},
                                                     with_entropy=False))(params, tokens)
    learner = np.asarray(learner)
    worst = 0.0
    for i, (prompt, result) in enumerate(zip(prompts, results)):
        span = slice(len(prompt), len(prompt) + len(result.output_ids))
        worst = max(worst, float(np.abs(learner[i, span] - np.asarray(result.logprobs)).max()))
    print(f"sampled log-probs vs learner: max |delta| = {worst:.2e}")
    assert worst < 1e-4
