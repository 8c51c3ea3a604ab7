"""The kernels under an update, XLA:CPU beside PyTorch, each in a process of its own: where a
gap between rl_tpu's update and PyTorch's comes from, and what no change to rl_tpu can close.

  python benchmarks/cpu_kernels.py                   # peer-shape matmuls, dots, attention
  python benchmarks/cpu_kernels.py --seq_lens 384,1536 --rounds 2

Three tables, each cell the median of --repeats timed calls after one warm-up:
- matmul: [M, K] x [K, N] at the peer model's update shapes (M = 8 x T tokens) and decode
  shapes (M = batch rows), GFLOP/s;
- batched dots of attention's shapes, [B=8, K=2] batches of [G*C=512 rows, H=64] query rows
  against T=1536 keys, in the four forms a flash-style attention uses: scores (q k^T: a
  64-long contraction, a [512, 1536] output), p v (NN), p^T do and ds^T q (the [512, 1536]
  operand transposed), ms (same FLOPs in every form);
- causal grouped-query attention (4 query heads on 2 kv heads of 64, 8 rows), forward and
  forward + backward, ms: rl_tpu's `segment_causal_attention` (query blocks of
  --attention_block) against PyTorch's `scaled_dot_product_attention` (its fused CPU kernel).
Threads as in the other head-to-head benchmarks (benchmarks/side_process.py).
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Only numpy and the side-process helper at the top: a PyTorch child must not load JAX.
import numpy as np  # noqa: E402
from absl import flags  # noqa: E402

from benchmarks import side_process  # noqa: E402
from benchmarks.side_process import median  # noqa: E402

flags.DEFINE_string("seq_lens", "96,384,1536", "Tokens per row of the update's matmuls and "
                    "of the attention rows (8 rows each).")
flags.DEFINE_integer("attention_block", 256, "rl_tpu's query block (model.attention_block).")
flags.DEFINE_integer("repeats", 5, "Timed calls per cell.")
flags.DEFINE_integer("rounds", 1, "Processes per side, interleaved.")
flags.DEFINE_enum("side", "", ["", "jax", "torch"], "Internal: run one side's process.")
flags.DEFINE_string("spec", "", "Internal: the side process's JSON spec.")
flags.DEFINE_string("result", "", "Internal: where the side process writes its result.")

ROWS, HIDDEN, MLP, VOCAB, HEADS, KV_HEADS, HEAD_DIM = 8, 256, 768, 2048, 4, 2, 64
DOT_FORMS = ("scores q k^T", "p v", "p^T do", "ds^T q")


def matmul_shapes(seq_lens) -> list[tuple[int, int, int]]:
    """(M, K, N): the update's projections at 8 x T tokens, then decode's at 8 and 128 rows."""
    out = []
    for t in seq_lens:
        m = ROWS * t
        out += [(m, HIDDEN, MLP), (m, MLP, HIDDEN), (m, HIDDEN, VOCAB)]
    return out + [(b, HIDDEN, n) for b in (8, 128) for n in (MLP, VOCAB)]


def _time_ms(fn, repeats: int) -> float:
    fn()  # warm-up (JAX: the compile)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * median(times)


def run_jax(spec: dict) -> dict:
    import jax
    import jax.numpy as jnp

    from rl_tpu.models.blocked_attention import segment_causal_attention

    rng, reps = np.random.default_rng(0), spec["repeats"]
    rand = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    ready = jax.block_until_ready
    out = {"matmul": {}, "dots": {}, "attention": {}}
    for m, k, n in spec["matmuls"]:
        a, b = rand(m, k), rand(k, n)
        f = jax.jit(jnp.matmul)
        out["matmul"][f"{m}x{k}x{n}"] = _time_ms(lambda: ready(f(a, b)), reps)
    batch, t = ((0, 1), (0, 1)), 1536
    q, key, p, do = rand(8, 2, 512, 64), rand(8, 2, t, 64), rand(8, 2, 512, t), rand(8, 2, 512, 64)
    forms = {"scores q k^T": (((3,), (3,)), q, key), "p v": (((3,), (2,)), p, key),
             "p^T do": (((2,), (2,)), p, do), "ds^T q": (((2,), (2,)), p, q)}
    for name, (contract, x, y) in forms.items():
        f = jax.jit(lambda x, y, c=contract: jax.lax.dot_general(x, y, (c, batch)))
        out["dots"][name] = _time_ms(lambda: ready(f(x, y)), reps)
    for t in spec["seq_lens"]:
        q, k, v = rand(ROWS, t, HEADS, HEAD_DIM), rand(ROWS, KV_HEADS, t, HEAD_DIM), rand(
            ROWS, KV_HEADS, t, HEAD_DIM)
        seg, block = jnp.ones((ROWS, t), jnp.int32), spec["attention_block"]
        fwd = jax.jit(lambda q, k, v: segment_causal_attention(q, k, v, seg, block))
        both = jax.jit(jax.grad(lambda q, k, v: jnp.sum(
            segment_causal_attention(q, k, v, seg, block) ** 2), argnums=(0, 1, 2)))
        out["attention"][str(t)] = [_time_ms(lambda: ready(fwd(q, k, v)), reps),
                                    _time_ms(lambda: ready(both(q, k, v)), reps)]
    return out


def run_torch(spec: dict) -> dict:
    import torch

    torch.set_num_threads(side_process.cores())
    reps = spec["repeats"]
    out = {"matmul": {}, "dots": {}, "attention": {}, "torch_version": torch.__version__}
    with torch.no_grad():
        for m, k, n in spec["matmuls"]:
            a, b = torch.randn(m, k), torch.randn(k, n)
            out["matmul"][f"{m}x{k}x{n}"] = _time_ms(lambda: a @ b, reps)
        t = 1536
        q, key, p, do = (torch.randn(8, 2, 512, 64), torch.randn(8, 2, t, 64),
                         torch.randn(8, 2, 512, t), torch.randn(8, 2, 512, 64))
        forms = {"scores q k^T": lambda: q @ key.transpose(-1, -2), "p v": lambda: p @ key,
                 "p^T do": lambda: p.transpose(-1, -2) @ do,
                 "ds^T q": lambda: p.transpose(-1, -2) @ q}
        for name, fn in forms.items():
            out["dots"][name] = _time_ms(fn, reps)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for t in spec["seq_lens"]:
        q = torch.randn(ROWS, HEADS, t, HEAD_DIM, requires_grad=True)
        k, v = (torch.randn(ROWS, KV_HEADS, t, HEAD_DIM, requires_grad=True) for _ in range(2))

        def fwd():
            with torch.no_grad():
                sdpa(q, k, v, is_causal=True, enable_gqa=True)

        def both():
            (sdpa(q, k, v, is_causal=True, enable_gqa=True) ** 2).sum().backward()

        out["attention"][str(t)] = [_time_ms(fwd, reps), _time_ms(both, reps)]
    return out


def parent_main(f) -> None:
    seq_lens = [int(t) for t in f.seq_lens.split(",")]
    spec = dict(seq_lens=seq_lens, matmuls=matmul_shapes(seq_lens), repeats=f.repeats,
                attention_block=f.attention_block)
    print(side_process.thread_note(), flush=True)
    results = {"jax": [], "torch": []}
    for _, side in side_process.round_order(f.rounds):
        results[side].append(side_process.run_side(os.path.abspath(__file__), side, spec))
    load = side_process.load_range([r for rs in results.values() for r in rs])

    def ms(side, table, key, i=None):
        values = [r[table][key] if i is None else r[table][key][i] for r in results[side]]
        return median(values)

    rows = []
    for m, k, n in spec["matmuls"]:
        key, flop = f"{m}x{k}x{n}", 2 * m * k * n
        jax_ms, torch_ms = ms("jax", "matmul", key), ms("torch", "matmul", key)
        rows.append([key, f"{flop / jax_ms / 1e6:.1f}", f"{flop / torch_ms / 1e6:.1f}",
                     f"{torch_ms / jax_ms:.2f}x", load])
    side_process.print_table(["matmul M x K x N", "XLA:CPU GFLOP/s", "PyTorch GFLOP/s",
                              "XLA / PyTorch speed", "load"], rows)
    rows = [[name, f"{ms('jax', 'dots', name):.1f}", f"{ms('torch', 'dots', name):.1f}", load]
            for name in DOT_FORMS]
    print()
    side_process.print_table(["[8, 2] x attention dot (1.6 GFLOP)", "XLA:CPU ms",
                              "PyTorch ms", "load"], rows)
    rows = []
    for t in seq_lens:
        j = [ms("jax", "attention", str(t), i) for i in (0, 1)]
        p = [ms("torch", "attention", str(t), i) for i in (0, 1)]
        rows.append([f"{ROWS} x {t}", f"{j[0]:.0f}", f"{p[0]:.0f}", f"{j[1]:.0f}", f"{p[1]:.0f}",
                     f"{p[1] / j[1]:.2f}x", load])
    print()
    side_process.print_table(["rows x T", "rl_tpu fwd ms", "PyTorch SDPA fwd ms",
                              "rl_tpu fwd+bwd ms", "PyTorch fwd+bwd ms",
                              "rl_tpu / PyTorch speed (fwd+bwd)", "load"], rows)


if __name__ == "__main__":
    side_process.run(parent_main, run_jax, run_torch)
