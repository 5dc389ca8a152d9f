"""The MX cast and GEMM kernels as torch custom ops (namespace ``mx_recipe``), with fake implementations.

torch.compile(fullgraph=True) traces through these as single opaque nodes; the fake
implementations give output shapes and dtypes without Triton or a GPU (Triton is imported
only when a real implementation runs). Shapes come from ``mx_kernels.common``, as in the
launchers, so the two cannot drift apart.

    torch.ops.mx_recipe.cast_dim0(x, elem, mode, blocked) -> (qdata, scale)
    torch.ops.mx_recipe.cast_dim1(x, elem, mode, blocked) -> (qdata, scale)          # x 2D or 3D
    torch.ops.mx_recipe.cast_dim0_dim1(x, elem, mode, blocked) -> (q0, s0, q1, s1)
    torch.ops.mx_recipe.cast_groups_dim1(x, offs, elem, mode) -> (qdata, blocked per-group scale)
    torch.ops.mx_recipe.fake_quant_dim0(x, elem, mode) -> dequantized MX along K, x's dtype and shape
    torch.ops.mx_recipe.fake_quant_dim1(x, elem, mode) -> dequantized MX along M, transposed ([.., K, M])
    torch.ops.mx_recipe.fake_quant_2d(x, elem, mode, along_k, along_m) -> (along K [.., M, K], along M
        [.., ceil32(M), K], x's layout); one read of x for both, an output not asked for is empty
    torch.ops.mx_recipe.fake_quant_groups_along_m(x, row_src, elem, mode) -> [M, K]: each token group
        quantized along M as if zero-padded to 32 rows (row_src: the padded layout), dequantized
    torch.ops.mx_recipe.mx_gemm(a_q, a_scale, a_elem, b_q, b_scale, b_elem, out_dtype) -> a @ b.T (mx_gemm.py)
"""

from __future__ import annotations

import torch
from mx_kernels.common import (
    check_cast,
    dim0_shapes,
    dim1_shapes,
    fake_quant_2d_shapes,
    fp8_dtype,
    groups_along_m_rows,
    groups_dim1_shapes,
)
from torch import Tensor


def _empty_outputs(x: Tensor, elem: str, shapes: tuple[tuple[int, ...], tuple[int, ...]]) -> tuple[Tensor, Tensor]:
    q_shape, s_shape = shapes
    return x.new_empty(q_shape, dtype=fp8_dtype(elem)), x.new_empty(s_shape, dtype=torch.float8_e8m0fnu)


@torch.library.custom_op("mx_recipe::cast_dim0", mutates_args=())
def cast_dim0(x: Tensor, elem: str, mode: str, blocked: bool) -> tuple[Tensor, Tensor]:
    from mx_kernels.cast_dim0 import cast_dim0 as launch

    return launch(x, elem, mode, blocked)


@cast_dim0.register_fake
def _(x: Tensor, elem: str, mode: str, blocked: bool) -> tuple[Tensor, Tensor]:
    check_cast(x, elem, mode, ndims=(2, 3), qdim=-1, op="cast_dim0")
    return _empty_outputs(x, elem, dim0_shapes(x.shape, blocked))


@torch.library.custom_op("mx_recipe::cast_dim1", mutates_args=())
def cast_dim1(x: Tensor, elem: str, mode: str, blocked: bool) -> tuple[Tensor, Tensor]:
    from mx_kernels.cast_dim1 import cast_dim1 as launch

    return launch(x, elem, mode, blocked)


@cast_dim1.register_fake
def _(x: Tensor, elem: str, mode: str, blocked: bool) -> tuple[Tensor, Tensor]:
    check_cast(x, elem, mode, ndims=(2, 3), qdim=-2, op="cast_dim1")
    return _empty_outputs(x, elem, dim1_shapes(x.shape, blocked))


@torch.library.custom_op("mx_recipe::cast_dim0_dim1", mutates_args=())
def cast_dim0_dim1(x: Tensor, elem: str, mode: str, blocked: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    from mx_kernels.cast_dim0_dim1 import cast_dim0_dim1 as launch

    return launch(x, elem, mode, blocked)


@cast_dim0_dim1.register_fake
def _(x: Tensor, elem: str, mode: str, blocked: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    check_cast(x, elem, mode, ndims=(2,), qdim=0, op="cast_dim0_dim1")
    check_cast(x, elem, mode, ndims=(2,), qdim=1, op="cast_dim0_dim1")
    return (
        *_empty_outputs(x, elem, dim0_shapes(x.shape, blocked)),
        *_empty_outputs(x, elem, dim1_shapes(x.shape, blocked)),
    )


@torch.library.custom_op("mx_recipe::cast_groups_dim1", mutates_args=())
def cast_groups_dim1(x: Tensor, offs: Tensor, elem: str, mode: str) -> tuple[Tensor, Tensor]:
    from mx_kernels.cast_groups_dim1 import cast_groups_dim1 as launch

    return launch(x, offs, elem, mode)


@cast_groups_dim1.register_fake
def _(x: Tensor, offs: Tensor, elem: str, mode: str) -> tuple[Tensor, Tensor]:
    check_cast(x, elem, mode, ndims=(2,), qdim=0, op="cast_groups_dim1")
    return _empty_outputs(x, elem, groups_dim1_shapes(x.shape, offs.shape[0], blocked=True))


@torch.library.custom_op("mx_recipe::fake_quant_dim0", mutates_args=())
def fake_quant_dim0(x: Tensor, elem: str, mode: str) -> Tensor:
    from mx_kernels.cast_dim0 import fake_quant_dim0 as launch

    return launch(x, elem, mode)


@fake_quant_dim0.register_fake
def _(x: Tensor, elem: str, mode: str) -> Tensor:
    check_cast(x, elem, mode, ndims=(2, 3), qdim=-1, op="fake_quant_dim0")
    return x.new_empty(x.shape)


@torch.library.custom_op("mx_recipe::fake_quant_dim1", mutates_args=())
def fake_quant_dim1(x: Tensor, elem: str, mode: str) -> Tensor:
    from mx_kernels.cast_dim1 import fake_quant_dim1 as launch

    return launch(x, elem, mode)


@fake_quant_dim1.register_fake
def _(x: Tensor, elem: str, mode: str) -> Tensor:
    check_cast(x, elem, mode, ndims=(2, 3), qdim=-2, op="fake_quant_dim1")
    return x.new_empty((*x.shape[:-2], x.shape[-1], x.shape[-2]))


@torch.library.custom_op("mx_recipe::fake_quant_2d", mutates_args=())
def fake_quant_2d(x: Tensor, elem: str, mode: str, along_k: bool, along_m: bool) -> tuple[Tensor, Tensor]:
    from mx_kernels.fake_quant_2d import fake_quant_2d as launch

    return launch(x, elem, mode, along_k, along_m)


@fake_quant_2d.register_fake
def _(x: Tensor, elem: str, mode: str, along_k: bool, along_m: bool) -> tuple[Tensor, Tensor]:
    check_cast(x, elem, mode, ndims=(2, 3), qdim=-1 if along_k else None, op="fake_quant_2d")
    k_shape, m_shape = fake_quant_2d_shapes(x.shape, along_k, along_m)
    return x.new_empty(k_shape), x.new_empty(m_shape)


@torch.library.custom_op("mx_recipe::fake_quant_groups_along_m", mutates_args=())
def fake_quant_groups_along_m(x: Tensor, row_src: Tensor, elem: str, mode: str) -> Tensor:
    from mx_kernels.fake_quant_2d import fake_quant_groups_along_m as launch

    return launch(x, row_src, elem, mode)


@fake_quant_groups_along_m.register_fake
def _(x: Tensor, row_src: Tensor, elem: str, mode: str) -> Tensor:
    check_cast(x, elem, mode, ndims=(2,), qdim=None, op="fake_quant_groups_along_m")
    groups_along_m_rows(row_src)
    return x.new_empty(x.shape[0], x.shape[1])


@torch.library.custom_op("mx_recipe::mx_gemm", mutates_args=())
def mx_gemm(
    a_q: Tensor, a_scale: Tensor, a_elem: str, b_q: Tensor, b_scale: Tensor, b_elem: str, out_dtype: torch.dtype
) -> Tensor:
    from mx_kernels.mx_gemm import mx_gemm as launch

    return launch(a_q, a_scale, a_elem, b_q, b_scale, b_elem, out_dtype)


@mx_gemm.register_fake
def _(a_q: Tensor, a_scale: Tensor, a_elem: str, b_q: Tensor, b_scale: Tensor, b_elem: str, out_dtype: torch.dtype):
    return a_q.new_empty((a_q.shape[0], b_q.shape[0]), dtype=out_dtype)
