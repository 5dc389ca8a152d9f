"""The MX reference: element formats, scale rules, ``to_mx`` and ``MXTensor``.

Pure PyTorch on any device. Every kernel and GEMM backend in this repository is tested
bit for bit against this file, and this file against the numerics contract of docs/DESIGN.md (Numerics contract):

* a block is 32 consecutive elements along the quantized dim; its scale is an E8M0
  exponent ``e`` (bias 127, 0xFF = NaN) and each element is stored as ``v / 2**e``
  rounded to nearest even in the element format, saturated to its max normal;
* ``floor`` (OCP MX v1.0, 6.3): ``e = floor(log2(amax)) - emax``;
* ``rceil`` (NVIDIA cuBLAS 1D block scaling): ``e = ceil(log2(amax / max_normal))``;
  both clamped to [-127, 127];
* a block holding a NaN gets the NaN scale, its fp8 elements are NaN (0x7F) and its
  fp4 elements 0 (e2m1 has no NaN); it dequantizes to NaN;
* an all-zero block gets e = -127 and zero elements;
* a block whose amax is Inf gets e = 127 under both rules (log2(inf) = inf, clamped;
  cuBLAS/TE code 0xFE) and its infinities saturate to +-max_normal;
* rounding is IEEE: a negative value that rounds to zero keeps its sign (fp8 0x80, e2m1 0x8).

Stochastic rounding (``rounding="stochastic"``, for MXFP4 gradients; recipe.py) changes only
the element rounding: a scaled value between adjacent grid points lo < |v| < hi of the element
format goes to hi with probability (|v| - lo) / (hi - lo), else to lo, so its expectation is v
(the draw added below the kept mantissa bits, the carry rounding up: ``round_to_format_stochastic``).
Scales, saturation to max_normal, NaN, Inf and zero (and -0) are exactly as above, and a value
on the grid never moves. The random bits are a uniform [0, 1) fp32 tensor, given or drawn from
a ``torch.Generator`` (the device's default one when none is given).

Both rules are computed exactly, on the fp32 bits of amax, with no division and no
log: for a normal amax = 1.m * 2**E, floor gives E - emax, and rceil gives E - emax
plus one when the mantissa of amax exceeds the mantissa of max_normal (amax / max_normal
then lies strictly above 2**(E - emax)). Evaluating ``ceil(log2(fl32(amax / max_normal)))``
in fp32 gives the same answer for every bf16 amax (tests/test_formats.py checks all of
them) and for every normal fp32 amax whose quotient is normal; it can differ only for an fp32
amax below max_normal * 2**-126, whose fp32 quotient is subnormal (e.g. e4m3 and
amax = (1.75 + 2**-23) * 2**-119: exact -126, fp32 quotient -127).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from mx_kernels.spec import (  # the constants the kernels share (docs/DESIGN.md, Architecture)
    BLOCK_SIZE,
    E2M1,
    E2M1_VALUES,
    E4M3,
    E5M2,
    E8M0_BIAS,
    E8M0_NAN,
    ELEM_FORMATS,
    FP8_NAN_BITS,
    ROUNDINGS,
    SCALE_EXP_MAX,
    SCALE_EXP_MIN,
    SCALE_RULES,
    ElemFormat,
    elem_format,
)

from mx_recipe.library import define

__all__ = [
    "BLOCK_SIZE",
    "E2M1",
    "E2M1_VALUES",
    "E4M3",
    "E5M2",
    "E8M0_BIAS",
    "E8M0_NAN",
    "ELEM_FORMATS",
    "FP8_NAN_BITS",
    "ROUNDINGS",
    "SCALE_EXP_MAX",
    "SCALE_EXP_MIN",
    "SCALE_RULES",
    "ElemFormat",
    "MXTensor",
    "elem_format",
    "fake_quant",
    "to_mx",
]


def _check_mode(mode: str) -> None:
    if mode not in SCALE_RULES:
        raise ValueError(f"unknown MX scale rule {mode!r}; expected one of {list(SCALE_RULES)}")


def scale_exponent(amax: torch.Tensor, fmt: ElemFormat, mode: str) -> torch.Tensor:
    """Unbiased shared exponent (int32, in [-127, 127]) for fp32 block maxima ``amax >= 0``.

    NaN blocks are not handled here (the caller masks them); +inf gives 127.
    """
    _check_mode(mode)
    bits = amax.to(torch.float32).view(torch.int32)
    biased = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    # A zero or subnormal amax has biased exponent 0: E = -127 clamps to -127 below,
    # which is the exact answer for both rules (floor(log2(amax)) - emax < -127 there).
    e = biased - 127 - fmt.emax
    if mode == "rceil":
        e = e + (mantissa > fmt.max_mantissa_bits).to(torch.int32)
    e = torch.where(biased == 0xFF, SCALE_EXP_MAX, e)  # amax = inf
    return e.clamp(SCALE_EXP_MIN, SCALE_EXP_MAX)


def exp2_fp32(e: torch.Tensor) -> torch.Tensor:
    """Exact 2**e in fp32 for int32 e in [-149, 127], built from bits (no pow, no rounding)."""
    normal = ((e + 127).clamp(min=1) << 23).view(torch.float32)
    subnormal = (torch.ones_like(e) << (e + 149).clamp(0, 22)).view(torch.float32)
    return torch.where(e >= -126, normal, subnormal)


def round_to_format(v: torch.Tensor, fmt: ElemFormat) -> torch.Tensor:
    """Round fp32 ``v`` to the nearest value of ``fmt`` (ties to even), saturating to
    +-max_normal. Returns fp32 values that ``fmt`` represents exactly; -0 stays -0."""
    v = v.clamp(-fmt.max_normal, fmt.max_normal)  # inf saturates; clamp-then-round == round-then-clamp
    _, exp = torch.frexp(v)  # |v| = m * 2**exp, m in [0.5, 1)
    k = (exp - 1).clamp(min=fmt.emin)  # exponent of v's binade, subnormals share emin's ulp
    ulp = exp2_fp32(k - fmt.mbits)
    return torch.round(v / ulp) * ulp  # power-of-two scaling is exact; torch.round is half-to-even


def round_to_format_stochastic(v: torch.Tensor, fmt: ElemFormat, uniform: torch.Tensor) -> torch.Tensor:
    """Round fp32 ``v`` to one of the two values of ``fmt`` around it, lo <= |v| <= hi, by Blackwell's
    ``cvt.rs`` rule: the draw's top 23 - mbits bits are added to |v|'s fp32 bits below the format's mantissa,
    and the carry out of those dropped bits rounds up to hi (truncation gives lo). That is up exactly when
    ``f + u' >= 1``, for the fraction f = (|v| - lo) / (hi - lo) and the draw u' = ``uniform`` truncated to
    multiples of 2**-(23 - mbits): with probability f for a continuous draw (f is a multiple of that step in
    every normal binade of the format, and torch.rand's 2**-24 steps are finer). Below the smallest normal
    2**emin, |v| is first offset by 2**emin in fp32 (ties to even), which lays the subnormal grid on the
    offset binade's, and the offset is taken off again: there f is rounded to that step first.

    Saturates to +-max_normal like ``round_to_format``; -0 stays -0; a value of the grid has f = 0 and never
    moves. ``uniform``: fp32 in [0, 1), the shape of ``v``. The e2m1 kernels compute the same steps in fp32
    and integers (``mx_kernels.quantize.round_e2m1``): no conversions, which are slow on the GPU."""
    v = v.clamp(-fmt.max_normal, fmt.max_normal)  # inf saturates; max_normal is on the grid
    mag = v.abs()
    dropped = 23 - fmt.mbits
    smallest_normal = 2.0**fmt.emin
    offset = torch.where(mag < smallest_normal, smallest_normal, 0.0)
    draw = torch.floor(uniform * 2.0**dropped).to(torch.int32)  # exact: a power-of-two scaling
    carried = ((mag + offset).view(torch.int32) + draw) & -(1 << dropped)
    return torch.copysign(carried.view(torch.float32) - offset, v)  # copysign keeps -0 for negatives


def _encode_e2m1(q: torch.Tensor) -> torch.Tensor:
    """fp32 values exactly in e2m1 -> 4-bit codes (uint8, 0..15), sign in bit 3."""
    mag = q.abs()
    code = torch.zeros_like(mag, dtype=torch.uint8)
    for i, value in enumerate(E2M1_VALUES[1:], start=1):
        code = torch.where(mag == value, torch.full_like(code, i), code)
    return code | (torch.signbit(q).to(torch.uint8) << 3)


def _decode_e2m1(code: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=code.device)
    mag = table[(code & 0x7).long()]
    return torch.where((code & 0x8) != 0, -mag, mag)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes along the last dim, two per byte, first element in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"cannot pack an odd last dim {codes.shape[-1]} into fp4 pairs")
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    lo, hi = packed & 0xF, packed >> 4
    return torch.stack([lo, hi], dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


@dataclass
class MXTensor:
    """A tensor in MX form, quantized in blocks of ``block_size`` along ``dim``.

    qdata: float8_e4m3fn / float8_e5m2 with the input's shape, or uint8 for e2m1 with
    the quantized dim halved (two codes per byte, first element in the low nibble).
    scale: float8_e8m0fnu with the input's shape, the quantized dim divided by block_size.
    """

    qdata: torch.Tensor
    scale: torch.Tensor
    elem: str
    dim: int
    block_size: int = BLOCK_SIZE

    @property
    def fmt(self) -> ElemFormat:
        return elem_format(self.elem)

    @property
    def shape(self) -> torch.Size:
        shape = list(self.qdata.shape)
        if self.elem == "e2m1":
            shape[self.dim] *= 2
        return torch.Size(shape)

    def t(self) -> MXTensor:
        """The transpose of a 2D MXTensor (a view; blocks stay along the same data)."""
        if self.qdata.dim() != 2:
            raise ValueError(f"MXTensor.t() needs 2 dims, got {self.qdata.dim()}")
        return MXTensor(self.qdata.t(), self.scale.t(), self.elem, 1 - self.dim, self.block_size)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """element * 2**e in fp32 (exact), NaN where the scale is NaN, then cast to dtype."""
        if self.elem == "e2m1":
            elems = _decode_e2m1(unpack_fp4(self.qdata.movedim(self.dim, -1))).movedim(-1, self.dim)
        else:
            elems = self.qdata.to(torch.float32)
        biased = self.scale.view(torch.uint8).to(torch.int32)
        factor = exp2_fp32(biased - E8M0_BIAS)
        factor = torch.where(biased == E8M0_NAN, torch.nan, factor)
        factor = factor.repeat_interleave(self.block_size, dim=self.dim)
        return (elems * factor).to(dtype)


def dequantize_along_last(
    qdata: torch.Tensor, scale: torch.Tensor, elem: str, dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """MX data quantized in blocks of 32 along its last dim -> its values in ``dtype`` (written into ``out``, any
    strides, where given), bit for bit ``MXTensor.dequantize(dtype)``, with the block factors broadcast rather than
    repeated and no fp32 copy of the elements (the emulated backward and the MX all-gather run it at peak memory).
    Elements and 2**e (e in [-127, 127]) are exact in bf16, and PyTorch multiplies bf16 in fp32: one rounding to
    ``dtype``, as ``dequantize`` does."""
    if elem == "e2m1":
        codes = unpack_fp4(qdata)
        table = torch.tensor(E2M1_VALUES, dtype=dtype, device=codes.device)
        mag = table[(codes & 0x7).long()]
        elems = torch.where((codes & 0x8) != 0, -mag, mag)
    else:
        elems = qdata.to(dtype)
    biased = scale.view(torch.uint8).to(torch.int32)
    factor = torch.where(biased == E8M0_NAN, torch.nan, exp2_fp32(biased - E8M0_BIAS)).to(dtype)
    blocks = (-1, BLOCK_SIZE)
    if out is None:
        return (elems.unflatten(-1, blocks) * factor.unsqueeze(-1)).flatten(-2)
    torch.mul(elems.unflatten(-1, blocks), factor.unsqueeze(-1), out=out.unflatten(-1, blocks))
    return out


def _uniform_like(x: torch.Tensor) -> torch.Tensor:
    return torch.rand(x.shape, dtype=torch.float32, device=x.device)


# Tagged nondeterministic_seeded: a random op to torch.compile (never constant-folded, kept in program order among
# the draws). CompositeExplicitAutograd: one implementation for every device.
define(
    "uniform_like(Tensor x) -> Tensor",
    _uniform_like,
    lambda x: x.new_empty(x.shape, dtype=torch.float32),
    keys=("CompositeExplicitAutograd",),
    tags=(torch.Tag.nondeterministic_seeded,),
)


def uniform_like(x: torch.Tensor) -> torch.Tensor:
    """``torch.rand(x.shape)`` in fp32 on x's device, from the default generator: stochastic
    rounding's random bits. An op that takes x, so that under torch.compile the draw stays where x
    is made: AOTAutograd moves a random op that reads nothing of the backward (torch.rand(shape))
    into the forward graph and saves its output for backward, 4 bytes per element of the gradient."""
    return torch.ops.mx_recipe.uniform_like(x)


def _check_rounding(rounding: str, generator: torch.Generator | None, uniform: torch.Tensor | None) -> None:
    if rounding not in ROUNDINGS:
        raise ValueError(f"unknown MX rounding {rounding!r}; expected one of {list(ROUNDINGS)}")
    if rounding == "nearest" and (generator is not None or uniform is not None):
        raise ValueError("to_mx: generator and uniform are random bits for rounding='stochastic' only")


def _quantize_blocks(
    x: torch.Tensor,
    elem: str,
    mode: str,
    dim: int,
    block_size: int,
    rounding: str,
    generator: torch.Generator | None,
    uniform: torch.Tensor | None,
) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The MX math shared by ``to_mx`` and ``fake_quant``, with ``dim`` moved last and cut in blocks:
    (dim as a non-negative index, elements q (fp32 values of the format) [..., n, block_size],
    exponents e (int32) [..., n, 1], NaN-block mask [..., n, 1])."""
    fmt = elem_format(elem)
    _check_mode(mode)
    _check_rounding(rounding, generator, uniform)
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"to_mx takes bf16 or fp32 input, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("to_mx needs at least one dimension")
    if not -x.dim() <= dim < x.dim():  # dim % x.dim() would take dim=2 of a 2D tensor as dim 0
        raise ValueError(
            f"to_mx: dim {dim} is out of range for a {x.dim()}D tensor (expected -{x.dim()} to {x.dim() - 1})"
        )
    dim = dim % x.dim()
    if x.shape[dim] % block_size:
        raise ValueError(
            f"to_mx: dim {dim} of shape {tuple(x.shape)} has size {x.shape[dim]}, "
            f"which is not a multiple of the block size {block_size}"
        )
    v = x.to(torch.float32).movedim(dim, -1)
    blocks = v.reshape(*v.shape[:-1], v.shape[-1] // block_size, block_size)
    amax = blocks.abs().amax(dim=-1, keepdim=True)  # NaN propagates into amax
    is_nan = amax.isnan()
    e = scale_exponent(torch.where(is_nan, 0.0, amax), fmt, mode)
    scaled = blocks * exp2_fp32(-e)
    if rounding == "nearest":
        q = round_to_format(scaled, fmt)
    else:
        if uniform is None and generator is None:
            uniform = uniform_like(x.detach())
        elif uniform is None:
            uniform = torch.rand(x.shape, generator=generator, device=x.device, dtype=torch.float32)
        elif uniform.shape != x.shape or uniform.dtype != torch.float32:
            raise ValueError(
                f"to_mx: uniform must be fp32 of the input's shape {tuple(x.shape)}, "
                f"got {uniform.dtype} {tuple(uniform.shape)}"
            )
        q = round_to_format_stochastic(scaled, fmt, uniform.movedim(dim, -1).reshape(blocks.shape))
    return dim, q, e, is_nan


def fake_quant(
    x: torch.Tensor, elem: str = "e4m3", mode: str = "floor", dim: int = -1, block_size: int = BLOCK_SIZE,
    rounding: str = "nearest", generator: torch.Generator | None = None, uniform: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """``to_mx(x, ...).dequantize(x.dtype)``, bit for bit, without the MXTensor in between.

    Elements times 2**e in fp32, NaN for NaN blocks: the same products ``dequantize`` forms.
    No e8m0 scales and no packed fp4 on the way, which skips the e2m1 encode and decode and lets
    inductor's CPU backend compile it (its C++ code generation has no float8_e8m0fnu type).
    """
    dim, q, e, is_nan = _quantize_blocks(x, elem, mode, dim, block_size, rounding, generator, uniform)
    out = torch.where(is_nan, torch.nan, q * exp2_fp32(e))
    return out.flatten(-2).movedim(-1, dim).contiguous().to(x.dtype)  # flatten: also for 0 rows


def to_mx(
    x: torch.Tensor, elem: str = "e4m3", mode: str = "floor", dim: int = -1, block_size: int = BLOCK_SIZE,
    rounding: str = "nearest", generator: torch.Generator | None = None, uniform: torch.Tensor | None = None,
) -> MXTensor:  # fmt: skip
    """Quantize ``x`` (bf16 or fp32) to MX along ``dim`` in blocks of ``block_size``.

    ``rounding``: "nearest" (ties to even) or "stochastic", whose random bits are ``uniform`` (fp32
    in [0, 1), x's shape) when given, else ``torch.rand`` from ``generator`` (None: the default one).
    """
    fmt = elem_format(elem)
    dim, q, e, is_nan = _quantize_blocks(x, elem, mode, dim, block_size, rounding, generator, uniform)
    v_shape = (*q.shape[:-2], q.shape[-2] * block_size)
    biased = torch.where(is_nan, E8M0_NAN, e + E8M0_BIAS).to(torch.uint8)
    scale = biased.squeeze(-1).view(torch.float8_e8m0fnu).movedim(-1, dim).contiguous()

    if fmt.torch_dtype is None:
        codes = torch.where(is_nan, 0, _encode_e2m1(q)).to(torch.uint8)
        qdata = pack_fp4(codes.reshape(v_shape))
    else:
        bits = q.to(fmt.torch_dtype).view(torch.uint8)
        qdata = torch.where(is_nan, FP8_NAN_BITS, bits).to(torch.uint8)
        qdata = qdata.reshape(v_shape).view(fmt.torch_dtype)
    return MXTensor(qdata=qdata.movedim(-1, dim).contiguous(), scale=scale, elem=elem, dim=dim, block_size=block_size)
