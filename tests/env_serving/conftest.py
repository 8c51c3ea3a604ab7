"""Env-serving tests: make this directory importable, for the shared helper module `loopback`
(an env server on a free loopback port, in a thread)."""

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
