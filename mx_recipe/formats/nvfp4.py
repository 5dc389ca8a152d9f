"""The NVFP4 reference: ``to_nvfp4``, ``NVFP4Tensor``, the emulated GEMM operand, and the random Hadamard
transform of NVIDIA's NVFP4 training recipe (docs/DESIGN.md, "NVFP4").

NVFP4 stores e2m1 elements in blocks of 16 with one float8_e4m3fn scale per block and one fp32 scale
per tensor. The arithmetic follows NVIDIA's definition (Transformer Engine's NVFP4 quantizer, the
one its kernels are tested against), every step one fp32 operation rounded to nearest even:

* per tensor, from amax = max|x|: ``s_enc = 2688 / amax`` (448 * 6), capped at the fp32 max (amax = 0),
  1 where that is 0 (amax = Inf); ``s_dec = 1 / s_enc`` is the tensor's ``per_tensor_scale``;
* per block, from its amax b: ``d = b * (s_enc * fl(1/6))``, capped at the fp32 max, clamped to
  [-448, 448] and cast to e4m3 (round to nearest even, subnormals kept): the block scale ``s``;
* the element encode factor ``e = 1 / (float(s) * s_dec)``, capped at the fp32 max (s = 0);
* each element ``x * e`` rounded to e2m1 (nearest even, saturating at +-6; a negative value that
  rounds to zero keeps its sign, as in the MX reference), or stochastically (``rounding``);
* a value decodes as ``e2m1 * float(s) * s_dec``; the first product is exact.

A block holding a NaN gets the NaN scale (e4m3 0x7F) and zero elements, and decodes to NaN; a NaN
anywhere makes amax, and so every scale of the tensor, NaN. An infinite amax gives s_enc = 1, and
the infinities saturate to +-6 * 448 with their blocks' scale at 448.

``block_shape=(16, 16)``: one scale per 16x16 tile of the last two dims (the recipe's weights), so
that quantizing along either dim gives the same values: the forward and backward GEMMs see one
weight. The scales are stored per 1x16 block along ``dim`` (each tile's scale repeated over its 16
rows), as the GEMM reads them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from mx_kernels.spec import NVFP4_BLOCK

from mx_recipe.formats.mx import (
    E2M1,
    _check_rounding,
    _decode_e2m1,
    _encode_e2m1,
    pack_fp4,
    round_to_format,
    round_to_format_stochastic,
    uniform_like,
    unpack_fp4,
)

E4M3_MAX = 448.0
E2M1_MAX = 6.0
FP32_MAX = torch.finfo(torch.float32).max
BLOCK_SHAPES = ((1, NVFP4_BLOCK), (NVFP4_BLOCK, NVFP4_BLOCK))
HADAMARD_SIZE = 16


def per_tensor_scales(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(s_enc, s_dec), fp32 scalars, for a tensor whose max |value| is ``amax`` (see the module docstring)."""
    amax = amax.to(torch.float32)
    s_enc = torch.minimum(torch.div(E4M3_MAX * E2M1_MAX, amax), amax.new_tensor(FP32_MAX))
    s_enc = torch.where(s_enc == 0, torch.ones_like(s_enc), s_enc)  # amax = Inf; NaN stays NaN
    return s_enc, torch.div(1.0, s_enc)


@dataclass
class NVFP4Tensor:
    """A tensor in NVFP4, quantized in blocks of 16 along ``dim``.

    qdata: uint8, the input's shape with ``dim`` halved: two e2m1 codes per byte, the first element in
    the low nibble (the layout the hardware and ModelOpt checkpoints use).
    scale: float8_e4m3fn, the input's shape with ``dim`` divided by 16.
    per_tensor_scale: the fp32 decode scale s_dec (0-d), or None for one-level scaling (s_enc = 1).
    block_shape: (1, 16), or (16, 16) where each tile of the last two dims shares one scale.
    """

    qdata: torch.Tensor
    scale: torch.Tensor
    per_tensor_scale: torch.Tensor | None
    dim: int
    block_shape: tuple[int, int] = (1, NVFP4_BLOCK)

    @property
    def shape(self) -> torch.Size:
        shape = list(self.qdata.shape)
        shape[self.dim] *= 2
        return torch.Size(shape)

    def block_values(self) -> torch.Tensor:
        """e2m1 * float(scale) in fp32, exact: the values without the per-tensor scale (NaN for NaN blocks)."""
        elems = _decode_e2m1(unpack_fp4(self.qdata.movedim(self.dim, -1))).movedim(-1, self.dim)
        factor = self.scale.to(torch.float32).repeat_interleave(NVFP4_BLOCK, dim=self.dim)
        return elems * factor

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(e2m1 * float(scale)) * per_tensor_scale in fp32, then cast to ``dtype``."""
        values = self.block_values()
        if self.per_tensor_scale is not None:
            values = values * self.per_tensor_scale
        return values.to(dtype)


def _tile_amax(v: torch.Tensor) -> torch.Tensor:
    """For v [..., R, C]: the max |value| of each element's 16x16 tile of the last two dims, v's shape (NaN
    propagates)."""
    *lead, rows, cols = v.shape
    tiles = v.reshape(*lead, rows // NVFP4_BLOCK, NVFP4_BLOCK, cols // NVFP4_BLOCK, NVFP4_BLOCK)
    return tiles.abs().amax(dim=(-3, -1), keepdim=True).expand_as(tiles).reshape(v.shape)


def _check(x: torch.Tensor, dim: int, block_shape: tuple[int, int]) -> int:
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"to_nvfp4 takes bf16 or fp32 input, got {x.dtype}")
    if block_shape not in BLOCK_SHAPES:
        raise ValueError(f"to_nvfp4: block_shape must be one of {list(BLOCK_SHAPES)}, got {block_shape}")
    if x.dim() == 0 or not -x.dim() <= dim < x.dim():
        raise ValueError(f"to_nvfp4: dim {dim} is out of range for a {x.dim()}D tensor")
    dim %= x.dim()
    if x.shape[dim] % NVFP4_BLOCK:
        raise ValueError(f"to_nvfp4: dim {dim} of shape {tuple(x.shape)} is not a multiple of {NVFP4_BLOCK}")
    if block_shape != (1, NVFP4_BLOCK):
        if x.dim() < 2 or dim < x.dim() - 2 or any(s % NVFP4_BLOCK for s in x.shape[-2:]):
            raise ValueError(
                f"to_nvfp4: 16x16 blocks tile the last two dims (each a multiple of 16) and quantize along one of "
                f"them; got shape {tuple(x.shape)}, dim {dim}"
            )
    return dim


def _quantize(
    x: torch.Tensor,
    dim: int,
    per_tensor_scale: torch.Tensor | float | None,
    two_level: bool,
    block_shape: tuple[int, int],
    rounding: str,
    generator: torch.Generator | None,
    uniform: torch.Tensor | None,
) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The NVFP4 math, dim moved last and cut in blocks: (dim, e2m1 values q [..., n, 16] fp32, block scales
    s (e4m3) [..., n, 1], NaN-block mask [..., n, 1], s_dec or None)."""
    dim = _check(x, dim, block_shape)
    _check_rounding(rounding, generator, uniform)
    v = x.to(torch.float32)
    if not two_level:
        if per_tensor_scale is not None:
            raise ValueError("to_nvfp4: per_tensor_scale is for two-level scaling (two_level=True)")
        s_enc = s_dec = None
    elif per_tensor_scale is None:
        s_enc, s_dec = per_tensor_scales(v.abs().amax() if v.numel() else v.new_zeros(()))
    else:
        s_dec = torch.as_tensor(per_tensor_scale, dtype=torch.float32, device=x.device).reshape(())
        s_enc = torch.div(1.0, s_dec)
    tile_amax = _tile_amax(v) if block_shape != (1, NVFP4_BLOCK) else None  # in x's layout, before moving dim
    v = v.movedim(dim, -1)
    blocks = v.reshape(*v.shape[:-1], v.shape[-1] // NVFP4_BLOCK, NVFP4_BLOCK)
    if tile_amax is None:
        amax = blocks.abs().amax(dim=-1, keepdim=True)
    else:
        amax = tile_amax.movedim(dim, -1).reshape(blocks.shape)[..., :1]
    if s_enc is None:
        d = amax / E2M1_MAX  # one-level: the block scale is amax / 6 itself
    else:
        d = amax * (s_enc * torch.reciprocal(amax.new_tensor(E2M1_MAX)))
    d = torch.minimum(d, d.new_tensor(FP32_MAX)).clamp(-E4M3_MAX, E4M3_MAX)
    s = d.abs().to(torch.float8_e4m3fn)  # d >= 0; abs makes a NaN's sign (the platform's) +: the scale 0x7F
    s_value = s.to(torch.float32)
    denominator = s_value if s_dec is None else s_value * s_dec
    encode = torch.minimum(torch.div(1.0, denominator), denominator.new_tensor(FP32_MAX))
    scaled = blocks * encode
    if rounding == "nearest":
        q = round_to_format(scaled, E2M1)
    else:
        if uniform is None:
            uniform = (
                uniform_like(x.detach())
                if generator is None
                else torch.rand(x.shape, generator=generator, device=x.device, dtype=torch.float32)
            )
        elif uniform.shape != x.shape or uniform.dtype != torch.float32:
            raise ValueError(f"to_nvfp4: uniform must be fp32 of shape {tuple(x.shape)}, got {uniform.dtype}")
        q = round_to_format_stochastic(scaled, E2M1, uniform.movedim(dim, -1).reshape(blocks.shape))
    return dim, q, s, s_value.isnan(), s_dec


def to_nvfp4(
    x: torch.Tensor,
    dim: int = -1,
    per_tensor_scale: torch.Tensor | float | None = None,
    *,
    two_level: bool = True,
    block_shape: tuple[int, int] = (1, NVFP4_BLOCK),
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
    uniform: torch.Tensor | None = None,
) -> NVFP4Tensor:
    """Quantize ``x`` (bf16 or fp32) to NVFP4 along ``dim``.

    ``per_tensor_scale``: the decode scale s_dec to use (s_enc = 1 / s_dec), e.g. one shared by several
    tensors; None computes it from x's amax. ``two_level=False``: no per-tensor scale (s_enc = 1).
    ``block_shape``: (1, 16), or (16, 16) tiles over the last two dims. ``rounding``: "nearest" or
    "stochastic" (random bits ``uniform``, else drawn from ``generator`` or the default generator)."""
    dim, q, s, is_nan, s_dec = _quantize(x, dim, per_tensor_scale, two_level, block_shape, rounding, generator, uniform)
    codes = torch.where(is_nan, 0, _encode_e2m1(q)).to(torch.uint8)
    qdata = pack_fp4(codes.flatten(-2))
    scale = s.squeeze(-1).movedim(-1, dim).contiguous()
    return NVFP4Tensor(qdata.movedim(-1, dim).contiguous(), scale, s_dec, dim, block_shape)


def nvfp4_operand(
    x: torch.Tensor,
    dim: int = -1,
    per_tensor_scale: torch.Tensor | float | None = None,
    *,
    two_level: bool = True,
    block_shape: tuple[int, int] = (1, NVFP4_BLOCK),
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
    uniform: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The emulated GEMM's view of ``to_nvfp4(x, ...)``: (e2m1 * float(scale) in x's dtype, s_dec).

    The product is exact in bf16 (at most 6 significant bits, between 2**-10 and 2688), so a GEMM of two
    such operands in bf16 with fp32 accumulation, times both tensors' s_dec, is the NVFP4 GEMM up to the
    order of its sums, as on the hardware (block-scaled products in the MMA, the per-tensor scales as alpha).
    Bit for bit ``to_nvfp4(x, ...).block_values().to(x.dtype)``."""
    dim, q, s, is_nan, s_dec = _quantize(x, dim, per_tensor_scale, two_level, block_shape, rounding, generator, uniform)
    values = torch.where(is_nan, torch.nan, q * s.to(torch.float32))
    return values.flatten(-2).movedim(-1, dim).contiguous().to(x.dtype), s_dec


# --- the random Hadamard transform (RHT) ---


def random_signs(seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """16 random signs (+-1, fp32) from ``seed``: the D of the transform, fixed for a run. Sign i is -1 where bit
    i of SplitMix64(seed) is set: plain integer arithmetic, so torch.compile folds it into a constant (a
    torch.Generator in a compiled backward would break the graph)."""
    z = (seed + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    z ^= z >> 31
    return torch.tensor([1.0 - 2.0 * ((z >> i) & 1) for i in range(HADAMARD_SIZE)], dtype=torch.float32, device=device)


def _walsh_hadamard(v: torch.Tensor) -> torch.Tensor:
    """v [..., 16] @ H16 (Sylvester, entries +-1) by the fast transform: four stages of pairwise sums and
    differences at distances 1, 2, 4, 8, each an fp32 add or subtract, so the result does not depend on
    how a device orders a matrix product."""
    for h in (1, 2, 4, 8):
        pairs = v.reshape(*v.shape[:-1], HADAMARD_SIZE // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        v = torch.stack([a + b, a - b], dim=-2).reshape(*v.shape)
    return v


def hadamard_transform(x: torch.Tensor, signs: torch.Tensor, dim: int = -1, inverse: bool = False) -> torch.Tensor:
    """The 16-point random Hadamard transform along ``dim`` in blocks of 16, in fp32: each block v becomes
    v @ T with T = diag(signs) @ H16 / 4, an orthogonal matrix, so a GEMM whose two operands are both
    transformed along its contraction dim gives the same product. ``inverse``: v @ T.T.

    Each output is four fp32 additions and an exact scaling by 1/4 and +-1 from its 16 inputs: its error is
    at most 4 * 2**-24 * (sum of |v| over the block) / 4, about 6e-8 of the block's 1-norm."""
    if signs.shape != (HADAMARD_SIZE,):
        raise ValueError(f"hadamard_transform: signs must have shape ({HADAMARD_SIZE},), got {tuple(signs.shape)}")
    if x.dim() == 0 or not -x.dim() <= dim < x.dim() or x.shape[dim] % HADAMARD_SIZE:
        raise ValueError(f"hadamard_transform: dim {dim} of shape {tuple(x.shape)} is not a multiple of 16")
    v = x.to(torch.float32).movedim(dim, -1)
    blocks = v.reshape(*v.shape[:-1], v.shape[-1] // HADAMARD_SIZE, HADAMARD_SIZE)
    signs = signs.to(device=x.device, dtype=torch.float32)
    if inverse:  # v @ H D / 4
        out = _walsh_hadamard(blocks) * signs * 0.25
    else:  # v @ D H / 4
        out = _walsh_hadamard(blocks * signs) * 0.25
    return out.reshape(v.shape).movedim(-1, dim).contiguous()
