"""Reward over-optimisation curves: the proxy reward a policy is trained on and the gold reward
it stands in for, against how far the policy has moved from where it started.

    python -m launch.overoptimisation --runs kl0=/tmp/oo_kl0 --runs kl0.1=/tmp/oo_kl01 \\
        --out overoptimisation.png

Each run is an RL workdir trained against a learned reward (`reward.model_path`) with
`algo.log_kl=true` (or a kl_coef > 0), so that its metrics.jsonl has, each step:
  x      train/kl               KL(pi || pi_0) a token, the update's samples (algo.kl_estimator)
  proxy  rollout/reward_model   what the reward model paid those rollouts
  gold   rollout/reward_rule    what the env's own scorer says of the same rollouts
(`--gold`/`--proxy`/`--kl` name other keys, e.g. eval/success as gold). Gao et al. (2023) saw
the proxy keep rising with KL while the gold rose, peaked and fell: this draws the same two
curves for any reward model and env, one colour a run (typically one a KL coefficient), and
prints a table of each run's KL, proxy and gold per window of steps, and where its gold
peaked. Steps are averaged in `--windows` windows of equal length: a step's rewards are
noisy, their trend is the point.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import numpy as np

from rl_tpu.metrics import read_metrics

KL, PROXY, GOLD = "train/kl", "rollout/reward_model", "rollout/reward_rule"


@dataclasses.dataclass
class Curve:
    """One run's windows: mean step, KL, proxy and gold in each."""
    name: str
    steps: np.ndarray
    kl: np.ndarray
    proxy: np.ndarray
    gold: np.ndarray

    @property
    def gold_peak(self) -> int:
        return int(np.nanargmax(self.gold))


def read_curve(name: str, workdir: str, windows: int = 10, kl_key: str = KL,
               proxy_key: str = PROXY, gold_key: str = GOLD) -> Curve:
    """The run's RL steps that log all three keys, averaged in `windows` windows."""
    records = [r for r in read_metrics(workdir) if r.get("step", -1) >= 1]
    for key, what in ((kl_key, "run RL with --config.algo.log_kl=true (or a kl_coef > 0)"),
                      (proxy_key, "train against a reward model (--config.reward.model_path)"),
                      (gold_key, "log the gold reward under this key, or name it with --gold")):
        if not any(key in r for r in records):
            raise ValueError(f"{workdir}: no {key!r} in its metrics.jsonl; {what}")
    rows = [r for r in records if all(isinstance(r.get(k), (int, float)) and
                                      math.isfinite(r[k]) for k in (kl_key, proxy_key, gold_key))]
    if len(rows) < windows:
        windows = max(len(rows), 1)
    if not rows:
        raise ValueError(f"{workdir}: no step logs {kl_key}, {proxy_key} and {gold_key} together")
    parts = np.array_split(np.arange(len(rows)), windows)
    mean = lambda key: np.asarray([np.mean([rows[i][key] for i in p]) for p in parts])  # noqa: E731
    return Curve(name, mean("step"), mean(kl_key), mean(proxy_key), mean(gold_key))


def table(curves: Sequence[Curve]) -> list[str]:
    """Markdown: a row a window of each run, and each run's gold peak."""
    lines = ["| run | steps (mean) | KL / token | proxy | gold |", "|---|---|---|---|---|"]
    for c in curves:
        for s, k, p, g in zip(c.steps, c.kl, c.proxy, c.gold):
            lines.append(f"| {c.name} | {s:.0f} | {k:.4f} | {p:.3f} | {g:.3f} |")
    lines.append("")
    lines.append("| run | gold peak (window mean step) | KL there | gold there | gold last | "
                 "proxy last |")
    lines.append("|---|---|---|---|---|---|")
    for c in curves:
        i = c.gold_peak
        lines.append(f"| {c.name} | {c.steps[i]:.0f} | {c.kl[i]:.4f} | {c.gold[i]:.3f} | "
                     f"{c.gold[-1]:.3f} | {c.proxy[-1]:.3f} |")
    return lines


def plot(curves: Sequence[Curve], out: str, title: Optional[str] = None) -> None:
    """Two panels sharing the KL axis, proxy (left) and gold (right), one colour a run, each
    line following the run's windows in step order; saved to `out`. Apart, because the two
    rewards are on their own scales (a model's logits, an env's success)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), sharex=True)
    for i, c in enumerate(curves):
        left.plot(c.kl, c.proxy, "-o", color=f"C{i}", markersize=3, label=c.name)
        right.plot(c.kl, c.gold, "-o", color=f"C{i}", markersize=3, label=c.name)
        right.plot(c.kl[c.gold_peak], c.gold[c.gold_peak], "*", color=f"C{i}", markersize=12)
    for ax, what in ((left, "proxy reward (what the policy is paid)"),
                     (right, "gold reward (the env's verdict; * = peak)")):
        ax.set_xlabel("KL(pi || pi_0) per token")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title or "reward over-optimisation")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
