"""Causal attention's forward + backward at one layer's shape, dense against query blocks
(`model.attention_block`), as table rows:

  python benchmarks/attention.py --rows 16 --seq_len 1536 --blocks 0,256,512

Random q/k/v of a tiny model's heads (4 query heads on 2 kv heads of 16) through
`transformer.causal_attention`, the gradient of a sum of squares; block 0 is one dense block.
The loss of each block size is printed too: the blocked ones must equal the dense one.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from absl import app, flags  # noqa: E402

from benchmarks.common import median_ms, print_table  # noqa: E402
from rl_tpu.models.transformer import attention_mask, causal_attention  # noqa: E402

flags.DEFINE_integer("rows", 16, "Batch rows.")
flags.DEFINE_integer("seq_len", 1536, "Tokens per row.")
flags.DEFINE_integer("heads", 4, "Query heads.")
flags.DEFINE_integer("kv_heads", 2, "Key/value heads.")
flags.DEFINE_integer("head_dim", 16, "Head width.")
flags.DEFINE_string("blocks", "0,256,512", "Query block sizes to time (0 = dense).")
flags.DEFINE_integer("repeats", 3, "Timed calls per block size.")


def main(argv):
    del argv
    f = flags.FLAGS
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (f.rows, f.seq_len, f.heads, f.head_dim))
    key = jax.random.normal(kk, (f.rows, f.kv_heads, f.seq_len, f.head_dim))
    value = jax.random.normal(kv, (f.rows, f.kv_heads, f.seq_len, f.head_dim))
    mask = attention_mask(jnp.ones((f.rows, f.seq_len), jnp.int32))
    rows = []
    dense_ms = None
    for block in [int(b) for b in f.blocks.split(",")]:
        loss = lambda q, k, v, b=block: jnp.sum(causal_attention(q, k, v, mask, b) ** 2)  # noqa
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
        ms = median_ms(lambda: step(q, key, value), f.repeats)
        dense_ms = ms if dense_ms is None else dense_ms
        rows.append([block or "dense", f"{f.rows} x {f.seq_len}", f"{ms / 1e3:.2f}",
                     f"{dense_ms / ms:.2f}x", f"{float(step(q, key, value)[0]):.6g}"])
    print_table(["query block", "rows x tokens", "fwd+bwd s", "vs first", "loss"], rows)


if __name__ == "__main__":
    app.run(main)
