"""Weights & Biases beside TensorBoard: the scalars MetricsWriter logs, to one W&B run.

Turned on by `log.wandb_project` (`pip install 'rl_tpu[wandb]'`). The run is named after the
workdir (its last path part) and its id is saved in `<workdir>/wandb_run_id`, so a resumed run
(rerunning the same command) continues the same W&B run. W&B's own files go to
`<workdir>/wandb/` unless WANDB_DIR says otherwise; WANDB_MODE=offline writes them there only,
for `wandb sync` later.

Every record carries its run step as the metric `step`, which W&B plots the others against
(`define_metric`): W&B's own step must only grow, and rl_tpu's does not (the SFT warm start logs
at negative steps; a resumed run logs again the steps after the checkpoint it restored). Those
redone steps appear twice in W&B's history; metrics.jsonl, which drops them, is the record.
"""

from __future__ import annotations

import os
import re
import secrets
import string
from typing import Any, Mapping, Optional

from rl_tpu.persistence.checkpoint_errors import RunWriteError

RUN_ID_FILE = "wandb_run_id"
WANDB_SUBDIR = "wandb"


def run_id(workdir: str) -> str:
    """The W&B run id of this workdir: the one saved there, or a new one, saved now."""
    path = os.path.join(workdir, RUN_ID_FILE)
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            saved = f.read().strip()
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", saved):
            raise ValueError(f"{path} holds {saved[:80]!r}, not a W&B run id; delete the file "
                             "to start a new W&B run")
        return saved
    # W&B's own ids: 8 characters of lowercase letters and digits
    new = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(new + "\n")
    except OSError as err:
        raise RunWriteError("the W&B run id", path, err) from err
    return new


class WandbWriter:
    """One W&B run per workdir; `write(step, scalars)` logs a record, `close()` finishes."""

    def __init__(self, workdir: str, project: str,
                 config: Optional[Mapping[str, Any]] = None):
        try:
            import wandb
        except ImportError as err:
            raise ModuleNotFoundError(
                f"log.wandb_project={project!r} needs wandb: pip install 'rl_tpu[wandb]' (or "
                "set --config.log.wandb_project='' to log without it)") from err
        workdir = os.path.abspath(workdir)
        self.run = wandb.init(
            project=project, name=os.path.basename(workdir), id=run_id(workdir),
            resume="allow", config=dict(config) if config else None,
            dir=None if os.environ.get("WANDB_DIR") else workdir)
        # the run's own step: the x-axis of every other metric
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        self.run.log({"step": int(step), **scalars})

    def close(self) -> None:
        if self.run is not None:
            run, self.run = self.run, None
            run.finish()
