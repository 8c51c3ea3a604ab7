"""Rollout engines: what plays the policy's turns, embedded or on servers.

The public names (each imported from its module on first use: `import rl_tpu.rollout` loads
neither JAX nor FastAPI; rl_tpu/lazy_api.py):

    RolloutEngine, SamplingParams,  the engine contract every engine implements, from
    GenerateRequest, GenerateResult, rl_tpu.core.engine (rl_tpu.rollout.engine re-exports it
    RolloutError                    for one release)
    JaxSampler                      the embedded engine: KV cache, compiled decode, on the
                                    sampler's devices
    ContinuousBatcher               continuous batching of a JaxSampler's requests in a pool
                                    of slots (the rollout server's)
    SGLangEngine                    SGLang servers as an engine (their weights synced)
    ScriptedEngine                  replies from a Python function of the prompt and turn
                                    (tests, examples)
    RolloutService, serve,          the rollout server (`python -m launch.serve_rollout`):
    ServerLimits                    the service, its HTTP app on a socket, its limits
    DiskWeightSync                  weights handed to servers through a shared directory
    ServerDown                      a server that did not answer after its retries
"""

from rl_tpu.lazy_api import lazy_api, public_names

_HOMES = {
    "rl_tpu.core.engine": ("RolloutEngine", "SamplingParams", "GenerateRequest",
                           "GenerateResult", "RolloutError"),
    ".sampler": ("JaxSampler",),
    ".continuous": ("ContinuousBatcher",),
    ".sglang": ("SGLangEngine",),
    ".scripted": ("ScriptedEngine",),
    ".server": ("RolloutService", "serve", "ServerLimits"),
    ".weight_sync": ("DiskWeightSync",),
    ".http_transport": ("ServerDown",),
}
__all__ = public_names(_HOMES)
__getattr__, __dir__ = lazy_api(__name__, _HOMES)
