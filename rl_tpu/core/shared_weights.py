"""The engine contract across hosts: waiting until servers that every host shares hold a
weight version before any host samples from them.

A contract of rl_tpu.core: whoever swaps an engine's weights (the recipes' synchronous loop,
rl_tpu/recipes/policy_chain.py, the off-policy producer in rl_tpu/offpolicy/) calls this one
function after `RolloutEngine.update_weights`, so that the off-policy package needs nothing of
the recipes. It uses only the root module `rl_tpu.parallel` (collectives over JAX processes),
which imports no rl_tpu package; it lives apart from core/engine.py because it needs JAX and
the engine interface does not.
"""

from __future__ import annotations

import json

import jax

from rl_tpu import parallel
from rl_tpu.core.engine import RolloutEngine


def wait_for_shared_weights(engine: RolloutEngine, version) -> None:
    """After a weight update of servers every host shares (SGLang's `shared_across_hosts`),
    which process 0 alone performs while the others return at once: a barrier, so that no
    host samples before the servers hold `version`. Main thread only; nothing for an engine
    of this host's own (the embedded sampler).

    With LoRA adapters (several versions loaded at once, adapter_versions.py), other hosts'
    requests may name `version` from then on, and process 0 learns the oldest version each
    other host may still name until the next such barrier, so that it unloads none of them."""
    if not getattr(engine, "shared_across_hosts", False):
        return
    parallel.sync_hosts(f"weights_{version}_loaded")
    engine.shared_weights_loaded(version)
    if jax.process_count() > 1 and engine.model_config is not None \
            and engine.model_config.lora is not None:
        oldest = engine.oldest_adapter_named()
        named = parallel.across_hosts_bytes(json.dumps(oldest).encode())
        if jax.process_index() == 0:
            engine.hold_adapters_for_other_hosts([json.loads(b) for b in named[1:]])
