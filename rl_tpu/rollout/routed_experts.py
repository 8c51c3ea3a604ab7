"""A mixture of experts' routed experts on the wire, as SGLang 0.5.23 sends them.

SGLang (launched with `--enable-return-routed-experts`, a request with
`"return_routed_experts": true`) puts in `meta_info["routed_experts"]` the base64 of an int32
array [prompt + output - 1, num_hidden_layers, top_k] in C order: for every position but the
last output id, each layer's experts (sglang/srt/state_capturer/routed_experts.py and the
detokenizer's `_b64_encode_per_request`). Every layer has a row, dense ones too; rl_tpu's
results (`GenerateResult.routed_experts`) hold the sparse layers' alone, [positions, sparse
layers, k], -1 where nothing was recorded. rl_tpu's own server sends SGLang's layout (its dense
layers' rows -1) and its client reads either server's.
"""

from __future__ import annotations

import base64
import binascii

import numpy as np

from rl_tpu.models.transformer import ModelConfig


def encode(routed: np.ndarray, cfg: ModelConfig) -> str:
    """`GenerateResult.routed_experts` [positions, sparse layers, k] -> SGLang's base64 of
    [positions, layers, k] int32, dense layers' rows -1."""
    sparse = cfg.moe.sparse_layers(cfg.num_layers)
    full = np.full((len(routed), cfg.num_layers, cfg.moe.top_k), -1, np.int32)
    full[:, list(sparse)] = routed
    return base64.b64encode(full.tobytes()).decode("ascii")


def decode(text: str, positions: int, cfg: ModelConfig) -> np.ndarray:
    """SGLang's base64 routed experts of a sample with `positions` rows -> [positions, sparse
    layers, k] int32. ValueError naming what does not fit `cfg` (a server serving another
    model, a truncated reply)."""
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, TypeError, ValueError) as err:
        raise ValueError(f"routed_experts is not base64 ({err})") from err
    per_position = cfg.num_layers * cfg.moe.top_k
    if len(raw) != 4 * positions * per_position:
        raise ValueError(
            f"routed_experts holds {len(raw)} bytes, but {positions} positions x "
            f"{cfg.num_layers} layers x top-{cfg.moe.top_k} int32 are "
            f"{4 * positions * per_position}: the server serves another model than the "
            "trainer's")
    full = np.frombuffer(raw, np.int32).reshape(positions, cfg.num_layers, cfg.moe.top_k)
    routed = full[:, list(cfg.moe.sparse_layers(cfg.num_layers))].copy()
    if routed.size and int(routed.max()) >= cfg.moe.num_experts:
        raise ValueError(f"routed_experts names expert {int(routed.max())}, but the model has "
                         f"{cfg.moe.num_experts}")
    return routed
