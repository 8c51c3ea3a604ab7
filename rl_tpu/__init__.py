"""rl_tpu: JAX-first reinforcement learning for LLM policies and agents.

Importing it has no side effects: the CPU default for machines without an accelerator is
`rl_tpu.jax_platform.default_to_cpu()`, which the launchers call and a notebook calls itself.
"""
