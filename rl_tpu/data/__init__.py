"""Task data: grain pipelines over TaskSources (tasks.py) and user JSONL datasets (jsonl.py).

TFDS and grain are imported only when a dataset is built/read or a stream is made, so importing
this package is cheap.
"""

from rl_tpu.data.jsonl import JsonlTaskSource, build_jsonl_dataset
from rl_tpu.data.tasks import TaskStream, eval_tasks

__all__ = ["JsonlTaskSource", "TaskStream", "build_jsonl_dataset", "eval_tasks"]
