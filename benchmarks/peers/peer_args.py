"""The flags and the prompts file every peer child shares (standard library only: each child
runs in its own venv, rl_tpu's, TRL's or Tunix's, and imports this from its own folder)."""

from __future__ import annotations

import argparse
import json


def parser(doc: str, prompts_help: str) -> argparse.ArgumentParser:
    """The children's common flags; a child adds its own to what this returns."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--model_dir", required=True, help="HF dir of the shared random model")
    p.add_argument("--prompts_file", required=True, help=prompts_help)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--completion", type=int, default=64)
    p.add_argument("--steps", type=int, default=4, help="steady steps after the first")
    p.add_argument("--lr", type=float, default=1e-6)
    return p


def prompt_steps(args) -> list[list[dict]]:
    """The first --steps + 1 steps of prompts ({"ids", "text"} each) from --prompts_file,
    which benchmarks/peers.py writes; exits naming the file when it holds too few."""
    with open(args.prompts_file) as f:
        per_step = json.load(f)["steps"]
    if len(per_step) < args.steps + 1:
        raise SystemExit(f"{args.prompts_file} holds {len(per_step)} steps of prompts; "
                         f"--steps {args.steps} needs {args.steps + 1}")
    return per_step[:args.steps + 1]
