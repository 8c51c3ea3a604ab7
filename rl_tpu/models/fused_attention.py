"""Fused attention kernels for the full-sequence path (training, scoring): causal within packed
segments, never holding a [T, T] matrix.

Shape letters: B batch, T length, N query heads, K kv heads, G = N / K, H head dim.

`model.attention_impl` picks the path of `Attention` without a cache:

  xla          rl_tpu's own query-blocked einsum with a recomputing backward
               (`blocked_attention.segment_causal_attention`), any device
  dot_product  `jax.nn.dot_product_attention`: cuDNN's fused flash attention on a GPU, XLA's
               dot-product attention elsewhere; the causal + same-segment mask as a boolean mask
  splash       splash attention (a Pallas TPU kernel, forward and backward): the causal mask
               and the segment ids go to the kernel, which skips blocks that are all masked.
               One multi-query kernel per kv head (vmapped over K), so GQA needs no repeated
               keys; on a mesh it runs inside `shard_map` over the batch (and kv heads on the
               tensor axis). T must be a multiple of 128 (the kernel's block), or below it.
               `interpret=True` runs the same kernel on CPU (the parity tests).

All three are the same function of q, k, v and the segment ids: padding (segment 0) attends
within itself, as in `transformer.attention_mask`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from rl_tpu import parallel

ATTENTION_IMPLS = ("xla", "dot_product", "splash")
SPLASH_BLOCK = 128


def segment_attention(q, k, v, segment_ids, impl: str, mesh=None, rules=None,
                      interpret: bool = False):
    """q [B, T, N, H], k/v [B, T, K, H], segment_ids [B, T] -> [B, T, N, H]: causal attention
    within segments by the fused `impl` ("dot_product" or "splash")."""
    if impl == "dot_product":
        return _dot_product(q, k, v, segment_ids, mesh)
    if impl == "splash":
        return _splash(q, k, v, segment_ids, mesh, rules, interpret)
    raise ValueError(f"attention_impl={impl!r} has no fused kernel; choose one of "
                     f"{ATTENTION_IMPLS[1:]} (or 'xla', the blocked einsum)")


def _dot_product(q, k, v, segment_ids, mesh):
    same = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]  # [B, 1, T, T]
    cudnn = parallel.platform(mesh) == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16)
    return jax.nn.dot_product_attention(q, k, v, mask=same, is_causal=True,
                                        implementation="cudnn" if cudnn else None)


def _splash(q, k, v, segment_ids, mesh, rules, interpret):
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as splash, splash_attention_mask as masks)

    b, t, n, h = q.shape
    kv_heads = k.shape[2]
    g = n // kv_heads
    block = min(SPLASH_BLOCK, t)
    if t % block:
        raise ValueError(f"splash attention needs a length that is a multiple of {block}, got "
                         f"{t}: use train.length_buckets of multiples of {SPLASH_BLOCK}, or "
                         "model.attention_impl=xla")
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                              block_q_dkv=block, block_kv_dkv=block,
                              block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    kernel = splash.make_splash_mqa(
        masks.MultiHeadMask([masks.CausalMask((t, t)) for _ in range(g)]), block_sizes=sizes,
        head_shards=1, q_seq_shards=1, interpret=interpret)
    # [B, K, G, T, H] queries (scaled: the kernel does not), [B, K, T, H] keys and values
    qs = (q * (1.0 / math.sqrt(h))).astype(q.dtype).reshape(b, t, kv_heads, g, h)
    qs = qs.transpose(0, 2, 3, 1, 4)
    ks, vs = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)

    def local(qs, ks, vs, seg):
        def one_row(q_row, k_row, v_row, s_row):  # [K, G, T, H], [K, T, H] x 2, [T]
            ids = splash.SegmentIds(q=s_row, kv=s_row)
            return jax.vmap(lambda qh, kh, vh: kernel(qh, kh, vh, segment_ids=ids))(
                q_row, k_row, v_row)
        return jax.vmap(one_row)(qs, ks, vs, seg)

    if mesh is not None and mesh.size > 1:
        spec = functools.partial(parallel.logical_to_spec, mesh=mesh,
                                 rules=parallel.DEFAULT_RULES if rules is None else rules)
        q_spec = spec(("act_batch", "act_kv_heads", None, None, None), shape=qs.shape)
        kv_spec = spec(("act_batch", "act_kv_heads", None, None), shape=ks.shape)
        seg_spec = spec(("act_batch", None), shape=segment_ids.shape)
        local = jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, seg_spec),
                              out_specs=q_spec, check_vma=False)
    out = local(qs, ks, vs, segment_ids.astype(jnp.int32))  # [B, K, G, T, H]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)
