"""Fake-quant along K and/or along M in one read of x, both results in x's own layout.

The emulated MX linear's backward needs the upstream gradient g [M, N] quantized along N (grad
input) and along M (grad weight), each dequantized to bf16 for a bf16 GEMM. A bf16 GEMM takes
either operand transposed for free, so the along-M result need not be written transposed (as
``fake_quant_dim1`` does, a transpose in registers): it can stay in g's layout, [M, N]. Then one
program quantizes its tile [BLOCK_M, BLOCK_K] as row blocks (32 along K) and as column blocks
(32 along M) from the same registers and writes two coalesced tiles: g read once, not twice.

Along M, rows past M read as zeros and the result has ceil(M / 32) * 32 rows: the zero-padded
operand the grad-weight GEMM uses (zero rows add nothing to its sum).

``fake_quant_groups_along_m`` is the MoE grad-weight variant: tile row i is x's row ``row_src[i]``
(zeros where it is -1), so each token group is quantized along M in blocks of 32 that start at
the group's first row, as if the group were zero-padded to a multiple of 32; each result row is
written back to its own row of x's shape and the padding rows are dropped. No padded copy is
written, and the grad-weight GEMM runs over the groups as they are (no padding FLOPs).

Along K alone this is the fake-quant of the emulated forward (``mx_recipe.ops.mx_cast.fake_quant_dim0``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from mx_kernels.common import fake_quant_2d_outputs, fake_quant_groups_outputs, interpreting, software_round
from mx_kernels.launch_cache import LaunchCache
from mx_kernels.quantize import column_blocks, draws_tile, fake_quant_blocks, tile_rows, to_fp32
from mx_kernels.spec import cdiv

# (BLOCK_M, BLOCK_K, num_warps), the best of H200 sweeps: both outputs of 16384 x 4096 and of 3D expert weights
# (87% of copy), e2m1 along M alone 93% dense and 91% over gathered token groups (83% on the smaller tile). Along M
# alone with stochastic rounding keeps x's layout for its row-major draws, and runs best on the smaller tile
# (66% against 61% gathered).
TILE = (32, 128, 4)
STOCHASTIC_ALONG_M_TILE = (32, 64, 2)


@triton.jit
def _fake_quant_2d_kernel(
    x_ptr, src_ptr, routed_ptr, k_ptr, m_ptr, seed_ptr, M, M_PAD, K, stride_xb, stride_xm, stride_xk,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, ALONG_K: tl.constexpr, ALONG_M: tl.constexpr, ELEM: tl.constexpr,
    RCEIL: tl.constexpr, SOFTWARE_ROUND: tl.constexpr, OUT_BF16_BITS: tl.constexpr, GATHER: tl.constexpr,
    STOCHASTIC: tl.constexpr, ROUTED: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_b = tl.program_id(2).to(tl.int64)  # E * M * K can pass 2**31
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    x_rows, has_data = tile_rows(rows, src_ptr, M, GATHER)  # GATHER: 2D x, M laid-out rows
    in_x = has_data[:, None] & (cols < K)[None, :]
    read_rows = x_rows
    if ROUTED:  # the routed row p holds x's row routed[p] (the gather x[routed], never written)
        read_rows = tl.load(routed_ptr + x_rows, mask=has_data, other=0)
    x_offs = pid_b * stride_xb + read_rows[:, None] * stride_xm + cols[None, :] * stride_xk
    x = to_fp32(tl.load(x_ptr + x_offs, mask=in_x, other=0.0), SOFTWARE_ROUND)
    seed = tl.load(seed_ptr) if STOCHASTIC else 0
    if ALONG_K:  # blocks of 32 along K: [BLOCK_M * BLOCK_K / 32, 32]
        blocks = tl.reshape(x, (BLOCK_M * BLOCK_K // 32, 32))
        u = 0.0
        if STOCHASTIC:  # each element draws by its index in the output (stream 0)
            u = draws_tile(seed, 0, pid_b * M + rows, pid_k * BLOCK_K, K, BLOCK_M, BLOCK_K, not SOFTWARE_ROUND)
            u = tl.reshape(u, (BLOCK_M * BLOCK_K // 32, 32))
        v = fake_quant_blocks(blocks, 1, ELEM, RCEIL, SOFTWARE_ROUND, OUT_BF16_BITS, u, STOCHASTIC)
        v = tl.reshape(v, (BLOCK_M, BLOCK_K))
        if GATHER:  # along K is row-local: each row to its own row of x's shape, as along M below
            k_offs = x_rows[:, None] * K + cols[None, :]
        else:
            k_offs = pid_b * M * K + rows.to(tl.int64)[:, None] * K + cols[None, :]
        tl.store(k_ptr + k_offs, v, mask=in_x)
    if ALONG_M:  # blocks of 32 along M: [BLOCK_M / 32, 32, BLOCK_K], reduced over the middle dim
        if STOCHASTIC:  # the draws are row-major in x's layout (by output row, which gathering scatters)
            blocks = tl.reshape(x, (BLOCK_M // 32, 32, BLOCK_K))
        else:
            blocks = column_blocks(x, 32)
        u = 0.0
        if STOCHASTIC:  # by the index in the output (stream 1): x's row when gathered, else the padded row
            out_rows = x_rows if GATHER else pid_b * M_PAD + rows
            # along M alone (STOCHASTIC_ALONG_M_TILE) Philox's wide multiplies took 88 registers against 80, a
            # program less an SM: 379.6 against 364.6 us (H200, 16384 x 16384; capped at 80, 368.8)
            wide = not SOFTWARE_ROUND and ALONG_K
            u = draws_tile(seed, 1, out_rows, pid_k * BLOCK_K, K, BLOCK_M, BLOCK_K, wide)
            u = tl.reshape(u, (BLOCK_M // 32, 32, BLOCK_K))
        v = fake_quant_blocks(blocks, 1, ELEM, RCEIL, SOFTWARE_ROUND, OUT_BF16_BITS, u, STOCHASTIC)
        v = tl.reshape(v, (BLOCK_M, BLOCK_K))
        if GATHER:  # each row back to its own row of x's shape; padding rows are dropped
            tl.store(m_ptr + x_rows[:, None] * K + cols[None, :], v, mask=in_x)
        else:
            m_offs = pid_b * M_PAD * K + rows.to(tl.int64)[:, None] * K + cols[None, :]
            tl.store(m_ptr + m_offs, v, mask=(rows < M_PAD)[:, None] & (cols < K)[None, :])


def fake_quant_2d(
    x: torch.Tensor, elem: str, mode: str, along_k: bool, along_m: bool, seed: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] or [E, M, K] (bf16; any strides) -> (along K, along M), each dequantized in x's dtype; elem e4m3,
    e5m2 or e2m1 (MXFP4: the e2m1 value times 2**e, ``mx_quantize.fake_quant_e2m1_blocks``).

    - along K: [.., M, K] = ``to_mx(x, elem, mode, dim=-1).dequantize(x.dtype)``;
    - along M: [.., ceil32(M), K], x zero-padded along M and quantized along it, not transposed:
      ``to_mx(pad(x).transpose(-2, -1).contiguous(), elem, mode).dequantize(x.dtype).transpose(-2, -1)``.

    ``seed``: int64 [1] on x's device: e2m1 rounded stochastically, each element with the draw of its index in
    its output (``mx_quantize.draws_tile``, stream 0 along K and 1 along M; K a multiple of 8). An output not
    asked for is an empty tensor. Bit for bit the reference's, given the same draws."""
    _require_bf16(x, "fake_quant_2d")
    return fake_quant_2d_outputs(x, elem, mode, along_k, along_m, _launch, "fake_quant_2d", fp4=True, seed=seed)


def fake_quant_groups_along_m(
    x: torch.Tensor, row_src: torch.Tensor, elem: str, mode: str, seed: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] (bf16; any strides), row_src int32 [R] -> [M, K] contiguous, in x's dtype.

    row_src lays x's rows out in padded token groups: R a multiple of 32, every row of x listed once,
    -1 for a padding row (``scale_layout.group_row_sources``). The laid-out rows are quantized along R in
    blocks of 32 and dequantized, and each comes back to its own row: bit for bit
    ``fake_quant_2d(x_padded, along_m=True)`` with the padding rows dropped. row_src is not checked on
    the GPU (no host sync): a row of x it does not list is left unwritten. ``seed``: stochastic rounding
    (e2m1), each element drawing by its index in the [M, K] output (stream 1)."""
    _require_bf16(x, "fake_quant_groups_along_m")
    return fake_quant_groups_outputs(x, row_src, elem, mode, _launch, "fake_quant_groups_along_m", fp4=True, seed=seed)


def fake_quant_groups(
    x: torch.Tensor, row_src: torch.Tensor, elem: str, mode: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16; any strides), row_src int32 [R] -> (along K, groups along M), each [M, K] contiguous:
    ``fake_quant_2d(x, along_k=True)``'s first result and ``fake_quant_groups_along_m(x, row_src)`` from one read
    of x (the MoE grouped GEMM's x for its forward and grad-weight GEMMs, g for its grad-input and grad-weight
    GEMMs). Rounds to nearest."""
    _require_bf16(x, "fake_quant_groups")
    return fake_quant_groups_outputs(x, row_src, elem, mode, _launch, "fake_quant_groups", fp4=True, along_k=True)


def fake_quant_routed_groups(
    x: torch.Tensor, routed: torch.Tensor, row_src: torch.Tensor, elem: str, mode: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``fake_quant_groups(x[routed], row_src, ...)`` without writing x[routed]: x [T, K] bf16, routed int64 [M] (rows
    of x, e.g. each token once per expert it is routed to, sorted by expert), row_src int32 [R] laying out the M
    routed rows in padded groups -> (along K, groups along M), each [M, K]. ``routed`` is not checked on the GPU."""
    _require_bf16(x, "fake_quant_routed_groups")
    return fake_quant_groups_outputs(
        x, row_src, elem, mode, _launch, "fake_quant_routed_groups", fp4=True, along_k=True, routed=routed
    )


def _require_bf16(x: torch.Tensor, op: str) -> None:
    # On an H200 the kernel gave wrong values for fp32 input (exact in the interpreter and for bf16 on the
    # GPU): refuse rather than return wrong numbers; the dispatch takes the reference for fp32.
    if x.dtype != torch.bfloat16 and not interpreting():
        raise NotImplementedError(f"{op}: the GPU kernel takes bf16 input, got {x.dtype}")


_LAUNCHES = LaunchCache(_fake_quant_2d_kernel)


def _launch(
    x: torch.Tensor, row_src: torch.Tensor | None, out_k: torch.Tensor, out_m: torch.Tensor, elem: str, mode: str,
    along_k: bool, along_m: bool, m: int, m_pad: int, seed: torch.Tensor | None = None,
    routed: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """``m``: the rows the kernel walks (x's, or row_src's with row_src); ``m_pad``: along M's rows."""
    software = software_round(x, "fake_quant_2d")
    stochastic = seed is not None
    key = (x.shape, x.stride(), x.dtype, row_src is None, elem, mode, along_k, along_m, m, m_pad, software, stochastic,
           None if routed is None else routed.shape)  # fmt: skip
    _LAUNCHES.launch_keyed(
        key,
        lambda: _kernel_launch(
            x, row_src, out_k, out_m, elem, mode, along_k, along_m, m, m_pad, software, seed, routed
        ),
        x_ptr=x, src_ptr=x if row_src is None else row_src, routed_ptr=x if routed is None else routed, k_ptr=out_k,
        m_ptr=out_m, seed_ptr=x if seed is None else seed,
    )  # fmt: skip


def _kernel_launch(
    x: torch.Tensor, row_src: torch.Tensor | None, out_k: torch.Tensor, out_m: torch.Tensor, elem: str, mode: str,
    along_k: bool, along_m: bool, m: int, m_pad: int, software: bool, seed: torch.Tensor | None,
    routed: torch.Tensor | None = None,
) -> tuple[tuple[int, int, int], dict]:  # fmt: skip
    """(grid, keyword arguments) of one launch."""
    x3 = x if x.dim() == 3 else x.unsqueeze(0)
    num_batch, _, k = x3.shape
    block_m, block_k, num_warps = STOCHASTIC_ALONG_M_TILE if seed is not None and not along_k else TILE
    bits = software and x.dtype == torch.bfloat16  # the interpreter: bf16 bits rounded by hand
    grid = (cdiv(m_pad if along_m else m, block_m), cdiv(k, block_k), num_batch)
    return grid, dict(
        x_ptr=x3, src_ptr=x3 if row_src is None else row_src, routed_ptr=x3 if routed is None else routed,
        k_ptr=out_k.view(torch.int16) if bits and along_k else out_k,
        m_ptr=out_m.view(torch.int16) if bits and along_m else out_m, seed_ptr=x3 if seed is None else seed,
        M=m, M_PAD=m_pad, K=k, stride_xb=x3.stride(0), stride_xm=x3.stride(1), stride_xk=x3.stride(2),
        BLOCK_M=block_m, BLOCK_K=block_k, ALONG_K=along_k, ALONG_M=along_m, ELEM=elem, RCEIL=mode == "rceil",
        SOFTWARE_ROUND=software, OUT_BF16_BITS=bits, GATHER=row_src is not None, STOCHASTIC=seed is not None,
        ROUTED=routed is not None, num_warps=num_warps,
    )  # fmt: skip
