"""Rewards beyond the env's own: a reward model, an LLM judge, and their weighted mix.

    mix               RewardMix: the env's reward, a reward model's score and a judge's verdict
                      combined by `reward.*` weights; the per-source metrics
    scorer            a reward model (HF *ForSequenceClassification) scoring on this host
    remote, server    the same model behind HTTP (`python -m launch.serve_reward`) and its client
    tokenizer_match   the check that a reward model reads the policy's token ids as meant
    judge             judge prompts and verdict parsers (pure Python)
    judge_reward      a judge's verdicts as a reward, played by a rollout engine
    overoptimisation  proxy-against-gold reward curves over KL (`python -m launch.overoptimisation`)

Import the module you need; this package imports none of them (a reward server, a model).
"""
