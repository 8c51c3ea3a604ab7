"""Drivers: each `run(config, workdir)` is one training job (rl.py, sft.py)."""
