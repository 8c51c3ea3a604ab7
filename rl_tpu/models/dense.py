"""A dense layer's `dot_general` whose weight gradient is ordered for the CPU's matmul.

Shape letters: R the input's leading (row) dims, e.g. B x T; I the contracted input dims;
O the kernel's output dims. A dense layer is y[R, O] = x[R, I] . W[I, O], and its weight
gradient is dW[I, O] = sum over R of x[R, I] g[R, O]: a matmul contracting the *leading* dims
of both operands.

JAX's transpose rule writes that gradient as dot(g, x) -> [O, I] and then transposes it. A
row-major GEMM wants its left operand contracted on its minor dims, so XLA:CPU transposes the
left one, here g, before the matmul, and it fuses that transpose into the elementwise producer
of g (the SwiGLU backward), where the loop emitter writes in transposed order and cannot
vectorise. On the Qwen2 shape of `benchmarks/rl_step.py` (32 x 96 tokens, F = 1024) each of
the two layers spent about 60 ms of a 470 ms backward in that one fusion; the transpose alone
takes 3 ms.

`dense_dot_general` computes the same gradient with the operand whose contracted width is
smaller on the left (dot(x, g) -> [I, O] when I <= O, else dot(g, x) -> [O, I], then a
kernel-sized transpose), so the transposed copy is the smaller activation. The math is the
same sum in another order; the forward and the input gradient are `lax.dot_general`'s own.
On TPU and GPU, whose compilers choose layouts for the matmul units themselves, the order
makes no difference; the rule is used everywhere so one model runs one program.
"""

from __future__ import annotations

from functools import partial

import jax
import numpy as np
from jax import lax


def _is_plain_dense(lhs_ndim: int, rhs_ndim: int, dimension_numbers) -> bool:
    """No batch dims and the kernel contracted on its leading dims, in order (DenseGeneral's
    kernel layout [I..., O...]): the case the weight-gradient rule below is written for."""
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    return (not lhs_batch and not rhs_batch and tuple(rhs_contract) == tuple(range(len(rhs_contract)))
            and len(rhs_contract) < rhs_ndim and len(lhs_contract) < lhs_ndim)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _dense_dot(lhs, rhs, dimension_numbers, precision, preferred_element_type):
    return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                           preferred_element_type=preferred_element_type)


def _dense_dot_fwd(lhs, rhs, dimension_numbers, precision, preferred_element_type):
    out = _dense_dot(lhs, rhs, dimension_numbers, precision, preferred_element_type)
    return out, (lhs, rhs)


def _dense_dot_bwd(dimension_numbers, precision, preferred_element_type, residuals, g):
    lhs, rhs = residuals
    (lhs_contract, rhs_contract), _ = dimension_numbers
    _, lhs_vjp = jax.vjp(lambda x: lax.dot_general(
        x, rhs, dimension_numbers, precision=precision,
        preferred_element_type=preferred_element_type), lhs)
    (d_lhs,) = lhs_vjp(g)

    # dW over the row dims R: the lhs dims not contracted, which lead g in the same order.
    rows = tuple(d for d in range(lhs.ndim) if d not in lhs_contract)
    g_rows = tuple(range(len(rows)))
    # The kernel's contracted dim k pairs with lhs dim lhs_contract[k]; dot_general keeps the
    # lhs's free dims in ascending order, so undo that sort to get the kernel's order.
    order = np.argsort(np.argsort(lhs_contract))
    in_size = int(np.prod([lhs.shape[d] for d in lhs_contract]))
    out_size = int(np.prod(g.shape[len(rows):]))
    g = g.astype(lhs.dtype)
    if in_size <= out_size:  # dot(x, g) -> [I (ascending lhs order), O]
        d_rhs = lax.dot_general(lhs, g, ((rows, g_rows), ((), ())), precision=precision)
        perm = (*order, *range(len(lhs_contract), rhs.ndim))
    else:  # dot(g, x) -> [O, I (ascending)]: transpose the kernel-sized result
        d_rhs = lax.dot_general(g, lhs, ((g_rows, rows), ((), ())), precision=precision)
        n_out = rhs.ndim - len(lhs_contract)
        perm = (*(n_out + k for k in order), *range(n_out))
    d_rhs = lax.transpose(d_rhs, perm) if perm != tuple(range(rhs.ndim)) else d_rhs
    return d_lhs.astype(lhs.dtype), d_rhs.astype(rhs.dtype)


_dense_dot.defvjp(_dense_dot_fwd, _dense_dot_bwd)


def dense_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    """`lax.dot_general` for flax's `DenseGeneral(dot_general=...)`: the same forward, with the
    weight gradient ordered as the module docstring explains. Anything but a plain dense
    contraction (batch dims, a kernel contracted off its leading dims) is `lax.dot_general`."""
    if not _is_plain_dense(lhs.ndim, rhs.ndim, dimension_numbers):
        return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                               preferred_element_type=preferred_element_type)
    return _dense_dot(lhs, rhs, _hashable(dimension_numbers), precision, preferred_element_type)


def _hashable(dimension_numbers):
    (lc, rc), (lb, rb) = dimension_numbers
    return (tuple(lc), tuple(rc)), (tuple(lb), tuple(rb))
