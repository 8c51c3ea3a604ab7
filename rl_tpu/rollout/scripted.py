"""A scripted RolloutEngine: canned outputs from a policy function, no model at all.

For tests of the agent loop and envs, env benchmarks (the loop's own overhead), and debugging
an env's prompts: `ScriptedEngine(tokenizer, policy)` answers every request with
`policy(prompt_text, turn)`, where turn counts the assistant turns already in the prompt
(ChatML headers, as the tiny models' and Qwen's templates write them).
"""

from __future__ import annotations

from rl_tpu.core.engine import GenerateResult, RolloutEngine


class ScriptedEngine(RolloutEngine):
    """Answers each request from `policy(prompt_text, turn)`, which gives the turn's output:
    "text" (its encoding + eos), ("cut", "text") (its encoding, no eos: finish "length"),
    ("ids", [ids]) (those ids + eos), or ("abort", "text"). Output longer than the request's
    max_new_tokens is cut there (finish "length"). Logprobs are fake but nonzero."""

    def __init__(self, tokenizer, policy):
        self.tok, self.policy = tokenizer, policy
        self.calls, self.results = [], {}  # results: prompt ids -> GenerateResult

    def generate(self, requests):
        self.calls.append(list(requests))
        out = []
        for r in requests:
            text = self.tok.decode(r.prompt_ids)
            turn = text.count("<|im_start|>assistant") - 1
            spec = self.policy(text, turn)
            kind, value = ("stop", spec) if isinstance(spec, str) else spec
            ids = list(value) if kind == "ids" else self.tok.encode(value)
            finish = {"cut": "length", "abort": "abort"}.get(kind, "stop")
            if finish == "stop":
                ids.append(self.tok.eos_token_id)
            if len(ids) > r.sampling.max_new_tokens:
                ids, finish = ids[:r.sampling.max_new_tokens], "length"
            logprobs = [-0.05 - 0.01 * ((turn * 7 + i) % 13) for i in range(len(ids))]
            res = GenerateResult(ids, logprobs, finish, weight_version=f"v{turn}",
                                 prompt_tokens=len(r.prompt_ids))
            self.results[tuple(r.prompt_ids)] = res
            out.append(res)
        return out

    def update_weights(self, params, version):
        pass

    def health(self):
        return True
