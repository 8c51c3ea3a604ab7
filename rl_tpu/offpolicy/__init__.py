"""Off-policy data: where a step's trajectories come from when they need not be fresh.

  producer.py  rollouts on the learner's call (synchronous) or from a thread of their own
               within a staleness bound (asynchronous, deterministic or free-running,
               partial rollouts), with what a resume needs of them
  replay.py    sample replay: past groups mixed into each update
"""
