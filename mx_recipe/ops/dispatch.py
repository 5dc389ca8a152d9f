"""Which implementation each MX cast runs: the one table and the one rule (docs/DESIGN.md, Kernel dispatch).

Every op has a pure-PyTorch reference (built on ``formats.to_mx``, the judge of every kernel), a Triton
kernel and, for Hopper, a Gluon kernel; all three give the same bits. ``implementation`` is the rule:

* the reference off CUDA, for fp32 input to a fake-quant (the fake-quant kernels take bf16), and for
  stochastic rounding of fp8;
* e2m1 (MXFP4): the Triton casts (packed codes) and the Triton fake-quants of bf16, to nearest or
  stochastically, on every CUDA device;
* the Gluon kernel on an NVIDIA GPU of compute capability 9.x for bf16 input, unless the kernel settings say
  ``gluon=False`` (``mx_recipe.ops.settings``);
* the Triton kernel on every other CUDA device (Blackwell included) and input.

The kernels run as torch custom ops (``mx_recipe.library``) with fake implementations, so torch.compile
traces them as opaque nodes without Triton or a GPU; the reference is plain PyTorch and traces as it is.
Every kernel launch goes through ``mx_kernels.launch_cache`` (the kernel setting ``launch_cache=False`` turns it
off). ``draw_seed`` draws the seed of every kernel's stochastic rounding, MX and NVFP4.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from mx_kernels.common import (
    check_cast,
    dim0_shapes,
    dim1_shapes,
    e2m1_reads_words,
    empty_outputs,
    fake_quant_2d_shapes,
    groups_along_m_rows,
    groups_dim1_shapes,
)
from mx_kernels.spec import BLOCK_SIZE, KERNEL_ELEMS
from torch import Tensor

from mx_recipe.formats.mx import fake_quant, to_mx
from mx_recipe.formats.scale_layout import to_blocked, to_blocked_3d, to_blocked_groups
from mx_recipe.library import define
from mx_recipe.ops.device import capability
from mx_recipe.ops.settings import get_kernel_settings

# --- the references: the ops' contracts in plain PyTorch ---


def _blocked(scale: Tensor, blocked: bool) -> Tensor:
    if not blocked:
        return scale
    return to_blocked_3d(scale) if scale.dim() == 3 else to_blocked(scale)


def reference_cast_dim0(x: Tensor, elem: str, mode: str, blocked: bool, **rounding) -> tuple[Tensor, Tensor]:
    ref = to_mx(x, elem, mode, dim=-1, **rounding)
    return ref.qdata, _blocked(ref.scale, blocked)


def reference_cast_dim1(x: Tensor, elem: str, mode: str, blocked: bool, **rounding) -> tuple[Tensor, Tensor]:
    ref = to_mx(x.transpose(-2, -1).contiguous(), elem, mode, dim=-1, **rounding)
    return ref.qdata, _blocked(ref.scale, blocked)


def reference_cast_dim0_dim1(x: Tensor, elem: str, mode: str, blocked: bool) -> tuple[Tensor, ...]:
    return (*reference_cast_dim0(x, elem, mode, blocked), *reference_cast_dim1(x, elem, mode, blocked))


def reference_cast_groups_dim1(x: Tensor, elem: str, mode: str, offs: Tensor) -> tuple[Tensor, Tensor]:
    ref = to_mx(x.t().contiguous(), elem, mode, dim=-1)
    return ref.qdata, to_blocked_groups(ref.scale, offs)


def _pad_m(x: Tensor) -> Tensor:
    """Zero rows appended along M (dim -2) up to a multiple of 32."""
    pad = -x.shape[-2] % BLOCK_SIZE
    return torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad else x


def _fake_quant_along_m(x: Tensor, elem: str, mode: str, **rounding) -> Tensor:
    """x [.., M, K] zero-padded to whole blocks along M, quantized along M, dequantized, in x's layout (stochastic
    rounding draws in the order of the transposed copy)."""
    xt = _pad_m(x).transpose(-2, -1).contiguous()
    return fake_quant(xt, elem, mode, dim=-1, **rounding).transpose(-2, -1).contiguous()


def reference_fake_quant_2d(
    x: Tensor, elem: str, mode: str, along_k: bool, along_m: bool, **rounding
) -> tuple[Tensor, Tensor]:
    """Along K first, then along M (the order in which stochastic rounding draws)."""
    k = fake_quant(x, elem, mode, dim=-1, **rounding) if along_k else x.new_empty(0)
    m = _fake_quant_along_m(x, elem, mode, **rounding) if along_m else x.new_empty(0)
    return k, m


def reference_fake_quant_groups_along_m(x: Tensor, elem: str, mode: str, row_src: Tensor, **rounding) -> Tensor:
    groups_along_m_rows(row_src)
    rows = x.shape[0]
    if not torch.compiler.is_compiling():  # reads values on the host; compiled graphs (fullgraph) cannot
        listed = row_src[row_src >= 0].long()
        if not torch.equal(listed.sort().values, torch.arange(rows, device=x.device)) or bool((row_src < -1).any()):
            raise ValueError(f"fake_quant_groups_along_m: row_src must list each of x's {rows} rows once, -1 elsewhere")
    in_x = row_src >= 0  # a row of x; -1: a padding row
    src = torch.where(in_x, row_src, rows).long()  # -1: the appended zero row
    fq = _fake_quant_along_m(torch.cat([x, x.new_zeros(1, x.shape[1])])[src], elem, mode, **rounding)
    # back to x's row order: padded row p goes to row src[p], padding row p to row rows + p (dropped); the
    # destinations are distinct, so this is deterministic, and the shapes do not depend on the values
    dest = torch.where(in_x, row_src, rows + torch.arange(row_src.shape[0], device=x.device, dtype=row_src.dtype))
    out = fq.new_empty(rows + row_src.shape[0], x.shape[1])
    out[dest.long()] = fq
    return out[:rows]


def reference_fake_quant_groups(x: Tensor, elem: str, mode: str, row_src: Tensor) -> tuple[Tensor, Tensor]:
    return fake_quant(x, elem, mode, dim=-1), reference_fake_quant_groups_along_m(x, elem, mode, row_src)


# --- the table ---


@dataclass(frozen=True)
class KernelOp:
    """One op: its reference, its Triton and Gluon launchers ("module:function" in mx_kernels, imported on
    first use, so that importing mx_recipe imports no Triton), and whether the kernels take bf16 only."""

    reference: Callable
    triton: str
    gluon: str
    bf16_only: bool = False
    fp4: bool = False  # the Triton kernel takes e2m1 too
    gluon_fp4: bool = False  # so does the Gluon one (bf16 read as words: ``mx_kernels.gluon.e2m1_casts``)
    stochastic: bool = False  # the Triton kernel rounds e2m1 stochastically too


OPS: dict[str, KernelOp] = {
    "cast_dim0": KernelOp(
        reference_cast_dim0, "mx.casts:cast_dim0", "gluon.casts:cast_dim0", fp4=True, stochastic=True
    ),
    "cast_dim1": KernelOp(
        reference_cast_dim1,
        "mx.casts:cast_dim1",
        "gluon.casts:cast_dim1",
        fp4=True,
        gluon_fp4=True,
        stochastic=True,
    ),
    "cast_dim0_dim1": KernelOp(
        reference_cast_dim0_dim1, "mx.casts:cast_dim0_dim1", "gluon.casts:cast_dim0_dim1", fp4=True
    ),
    "cast_groups_dim1": KernelOp(
        reference_cast_groups_dim1,
        "mx.cast_groups_dim1:cast_groups_dim1",
        "gluon.cast_groups:cast_groups_dim1",
        fp4=True,
    ),
    "fake_quant_2d": KernelOp(
        reference_fake_quant_2d,
        "mx.fake_quant_2d:fake_quant_2d",
        "gluon.fake_quant:fake_quant_2d",
        bf16_only=True,
        fp4=True,
        stochastic=True,
    ),
    "fake_quant_groups_along_m": KernelOp(
        reference_fake_quant_groups_along_m,
        "mx.fake_quant_2d:fake_quant_groups_along_m",
        "gluon.fake_quant:fake_quant_groups_along_m",
        bf16_only=True,
        fp4=True,
        stochastic=True,
    ),
    "fake_quant_groups": KernelOp(
        reference_fake_quant_groups,
        "mx.fake_quant_2d:fake_quant_groups",
        "gluon.fake_quant:fake_quant_groups",
        bf16_only=True,
        fp4=True,
    ),
}


def rule(
    op: str, capability: tuple[int, int] | None, dtype: torch.dtype, elem: str, rounding: str, gluon: bool = True
) -> str:
    """The one rule: "reference", "triton" or "gluon" for ``op`` on a device of CUDA compute ``capability``
    (None: not an NVIDIA CUDA device), input ``dtype``, element format and rounding; ``gluon``: the Gluon
    kernels are allowed (``KernelSettings.gluon``)."""
    spec = OPS[op]
    if capability is None:
        return "reference"
    takes = dtype == torch.bfloat16 or not spec.bf16_only
    if rounding != "nearest":  # e2m1 on the Triton casts and fake-quants (MXFP4 gradients); fp8 has no kernel
        return "triton" if elem == "e2m1" and spec.stochastic and takes else "reference"
    if elem not in KERNEL_ELEMS:  # e2m1: the Triton casts and fake-quants of bf16; on Hopper the Gluon cast along M
        if not (spec.fp4 and takes):
            return "reference"
        return "gluon" if spec.gluon_fp4 and gluon and capability[0] == 9 and dtype == torch.bfloat16 else "triton"
    if dtype != torch.bfloat16:
        return "reference" if spec.bf16_only else "triton"
    return "gluon" if gluon and capability[0] == 9 else "triton"


def implementation(op: str, x: Tensor, elem: str, rounding: str = "nearest") -> str:
    """``rule`` for ``op`` on x (the kernel settings are read at each call). The kernels' draws for stochastic
    rounding come eight to a Philox call along the last dim: x's last dim not a multiple of 8 takes the
    reference."""
    if rounding != "nearest" and x.shape[-1] % 8:
        return "reference"
    return rule(op, capability(x.device), x.dtype, elem, rounding, get_kernel_settings().gluon)


@functools.cache
def launcher(op: str, kind: str) -> Callable:
    """The mx_kernels function of ``op``'s ``kind`` ("triton" or "gluon") implementation."""
    module, name = getattr(OPS[op], kind).split(":")
    return getattr(importlib.import_module(f"mx_kernels.{module}"), name)


def _kernel(op: str, x: Tensor, elem: str) -> Callable:
    """Inside a custom op, where a kernel was chosen: the launcher the rule names for a nearest cast to
    ``elem`` (an input the kernels refuse reaches the Triton launcher, which says why)."""
    kind = implementation(op, x, elem)
    if kind == "gluon" and elem == "e2m1" and not e2m1_reads_words(x, elem, False, False):
        kind = "triton"  # the Gluon e2m1 kernel reads x as words of two elements: the strides decide, at run time
    return launcher(op, "gluon" if kind == "gluon" else "triton")


DEVICES = {"CPU": None, "Hopper (sm_90)": (9, 0), "Blackwell (sm_100)": (10, 0)}


def device_table() -> str:
    """What runs where, as the README's markdown table, from ``rule`` (e4m3/e5m2 and round-to-nearest unless
    the column says otherwise; "CUDA": the same on Hopper and Blackwell)."""
    header = [
        "op", *(f"{d}, bf16" for d in DEVICES), "Hopper, fp32", "Hopper, bf16, e2m1", "Blackwell, bf16, e2m1",
        "CUDA, bf16, e2m1, stochastic", "any device, fp8, stochastic",
    ]  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for op in OPS:
        cells = [rule(op, cap, torch.bfloat16, "e4m3", "nearest") for cap in DEVICES.values()]
        cells += [
            rule(op, (9, 0), torch.float32, "e4m3", "nearest"),
            rule(op, (9, 0), torch.bfloat16, "e2m1", "nearest"),
            rule(op, (10, 0), torch.bfloat16, "e2m1", "nearest"),
            rule(op, (10, 0), torch.bfloat16, "e2m1", "stochastic"),
            rule(op, (10, 0), torch.bfloat16, "e4m3", "stochastic"),
        ]
        lines.append("| " + " | ".join([f"`{op}`", *cells]) + " |")
    return "\n".join(lines)


# --- the custom ops ---


def _one_side_cast_op(name: str, qdim: int, shapes: Callable) -> None:
    """The op of the one-sided cast ``name`` (x [M, K] or [E, M, K], quantized along ``qdim``)."""

    def kernel(x: Tensor, elem: str, mode: str, blocked: bool, seed: Tensor | None = None) -> tuple[Tensor, Tensor]:
        if seed is not None:  # only the Triton kernel rounds stochastically
            return launcher(name, "triton")(x, elem, mode, blocked, seed)
        return _kernel(name, x, elem)(x, elem, mode, blocked)

    def fake(x: Tensor, elem: str, mode: str, blocked: bool, seed: Tensor | None = None) -> tuple[Tensor, Tensor]:
        check_cast(x, elem, mode, ndims=(2, 3), qdim=qdim, op=name, fp4=True)
        return tuple(empty_outputs(x, elem, shapes(x.shape, blocked)))

    define(f"{name}(Tensor x, str elem, str mode, bool blocked, Tensor? seed=None) -> (Tensor, Tensor)", kernel, fake)


_one_side_cast_op("cast_dim0", -1, dim0_shapes)
_one_side_cast_op("cast_dim1", -2, dim1_shapes)


def _cast_dim0_dim1_fake(x: Tensor, elem: str, mode: str, blocked: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    check_cast(x, elem, mode, ndims=(2,), qdim=0, op="cast_dim0_dim1", fp4=True)
    check_cast(x, elem, mode, ndims=(2,), qdim=1, op="cast_dim0_dim1", fp4=True)
    return (
        *empty_outputs(x, elem, dim0_shapes(x.shape, blocked)),
        *empty_outputs(x, elem, dim1_shapes(x.shape, blocked)),
    )


define(
    "cast_dim0_dim1(Tensor x, str elem, str mode, bool blocked) -> (Tensor, Tensor, Tensor, Tensor)",
    lambda x, elem, mode, blocked: _kernel("cast_dim0_dim1", x, elem)(x, elem, mode, blocked),
    _cast_dim0_dim1_fake,
)


def _cast_groups_dim1_fake(x: Tensor, elem: str, mode: str, offs: Tensor) -> tuple[Tensor, Tensor]:
    check_cast(x, elem, mode, ndims=(2,), qdim=0, op="cast_groups_dim1", fp4=True)
    return tuple(empty_outputs(x, elem, groups_dim1_shapes(x.shape, offs.shape[0], blocked=True)))


define(
    "cast_groups_dim1(Tensor x, str elem, str mode, Tensor offs) -> (Tensor, Tensor)",
    lambda x, elem, mode, offs: _kernel("cast_groups_dim1", x, elem)(x, offs, elem, mode),
    _cast_groups_dim1_fake,
)


def _fake_quant_2d_fake(
    x: Tensor, elem: str, mode: str, along_k: bool, along_m: bool, seed: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    check_cast(x, elem, mode, ndims=(2, 3), qdim=-1 if along_k else None, op="fake_quant_2d", fp4=True)
    k_shape, m_shape = fake_quant_2d_shapes(x.shape, along_k, along_m)
    return x.new_empty(k_shape), x.new_empty(m_shape)


def _fake_quant_2d_op(
    x: Tensor, elem: str, mode: str, along_k: bool, along_m: bool, seed: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    if seed is not None:  # only the Triton kernel rounds stochastically
        return launcher("fake_quant_2d", "triton")(x, elem, mode, along_k, along_m, seed)
    return _kernel("fake_quant_2d", x, elem)(x, elem, mode, along_k, along_m)


define(
    "fake_quant_2d(Tensor x, str elem, str mode, bool along_k, bool along_m, Tensor? seed=None) -> (Tensor, Tensor)",
    _fake_quant_2d_op,
    _fake_quant_2d_fake,
)


def _fake_quant_groups_along_m_fake(
    x: Tensor, elem: str, mode: str, row_src: Tensor, seed: Tensor | None = None
) -> Tensor:
    check_cast(x, elem, mode, ndims=(2,), qdim=None, op="fake_quant_groups_along_m", fp4=True)
    groups_along_m_rows(row_src)
    return x.new_empty(x.shape[0], x.shape[1])


def _fake_quant_groups_along_m_op(
    x: Tensor, elem: str, mode: str, row_src: Tensor, seed: Tensor | None = None
) -> Tensor:
    if seed is not None:
        return launcher("fake_quant_groups_along_m", "triton")(x, row_src, elem, mode, seed)
    return _kernel("fake_quant_groups_along_m", x, elem)(x, row_src, elem, mode)


define(
    "fake_quant_groups_along_m(Tensor x, str elem, str mode, Tensor row_src, Tensor? seed=None) -> Tensor",
    _fake_quant_groups_along_m_op,
    _fake_quant_groups_along_m_fake,
)


def _fake_quant_groups_fake(x: Tensor, elem: str, mode: str, row_src: Tensor) -> tuple[Tensor, Tensor]:
    check_cast(x, elem, mode, ndims=(2,), qdim=-1, op="fake_quant_groups", fp4=True)
    groups_along_m_rows(row_src)
    return x.new_empty(x.shape[0], x.shape[1]), x.new_empty(x.shape[0], x.shape[1])


define(
    "fake_quant_groups(Tensor x, str elem, str mode, Tensor row_src) -> (Tensor, Tensor)",
    lambda x, elem, mode, row_src: _kernel("fake_quant_groups", x, elem)(x, row_src, elem, mode),
    _fake_quant_groups_fake,
)


def reference_fake_quant_routed_groups(
    x: Tensor, elem: str, mode: str, routed: Tensor, row_src: Tensor
) -> tuple[Tensor, Tensor]:
    return reference_fake_quant_groups(x[routed], elem, mode, row_src)


def _fake_quant_routed_groups_op(x: Tensor, elem: str, mode: str, routed: Tensor, row_src: Tensor):
    from mx_kernels.mx.fake_quant_2d import fake_quant_routed_groups as launch  # Triton's only

    return launch(x, routed, row_src, elem, mode)


def _fake_quant_routed_groups_fake(x: Tensor, elem: str, mode: str, routed: Tensor, row_src: Tensor):
    check_cast(x, elem, mode, ndims=(2,), qdim=-1, op="fake_quant_routed_groups", fp4=True)
    groups_along_m_rows(row_src)
    return x.new_empty(routed.shape[0], x.shape[1]), x.new_empty(routed.shape[0], x.shape[1])


define(
    "fake_quant_routed_groups(Tensor x, str elem, str mode, Tensor routed, Tensor row_src) -> (Tensor, Tensor)",
    _fake_quant_routed_groups_op,
    _fake_quant_routed_groups_fake,
)


def _mx_gemm(
    a_q: Tensor, a_scale: Tensor, a_elem: str, b_q: Tensor, b_scale: Tensor, b_elem: str, out_dtype: torch.dtype
) -> Tensor:
    """The triton GEMM backend's ``tl.dot_scaled`` kernel (mx_kernels.mx.gemm); no reference or Gluon form."""
    from mx_kernels.mx.gemm import mx_gemm as launch

    return launch(a_q, a_scale, a_elem, b_q, b_scale, b_elem, out_dtype)


define(
    "mx_gemm(Tensor a_q, Tensor a_scale, str a_elem, Tensor b_q, Tensor b_scale, str b_elem, ScalarType out_dtype)"
    " -> Tensor",
    _mx_gemm,
    lambda a_q, a_scale, a_elem, b_q, b_scale, b_elem, out_dtype: a_q.new_empty(
        (a_q.shape[0], b_q.shape[0]), dtype=out_dtype
    ),
)


def draw_seed(x: Tensor, generator: torch.Generator | None) -> Tensor:
    """The seed of a kernel's Philox stream for stochastic rounding of x: int64 [1] on x's device, drawn from
    ``generator`` (None: the default generator of x's device)."""
    return torch.randint(0, 2**62, (1,), device=x.device, dtype=torch.int64, generator=generator)


def run(op: str, x: Tensor, elem: str, mode: str, *args, rounding: str = "nearest", generator=None):
    """``op`` on x: the reference or, through its custom op, the kernel the rule picks. Stochastic rounding:
    the reference draws from ``generator`` (None: the default one); a kernel from a Philox stream keyed by a
    seed drawn from it on x's device, so the two round differently for the same generator state."""
    if implementation(op, x, elem, rounding) == "reference":
        random = {} if rounding == "nearest" else dict(rounding=rounding, generator=generator)
        return OPS[op].reference(x, elem, mode, *args, **random)
    if rounding == "nearest":
        return getattr(torch.ops.mx_recipe, op)(x, elem, mode, *args)
    return getattr(torch.ops.mx_recipe, op)(x, elem, mode, *args, seed=draw_seed(x, generator))
