"""Philox4x32-10 in PyTorch: the stream the stochastic-rounding kernels (MX and NVFP4) draw from, to check them
bit for bit (``mx_kernels.quantize.draws_tile``)."""

from __future__ import annotations

import torch

_PHILOX_ROUND = (0xD2511F53, 0xCD9E8D57)
_PHILOX_KEY = (0x9E3779B9, 0xBB67AE85)
_MASK32 = 0xFFFFFFFF


def _mul_wide(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of the 64-bit product of the constant ``a`` and ``b`` (int64 holding uint32),
    in 16-bit halves so that no partial product overflows int64."""
    a_hi, a_lo = a >> 16, a & 0xFFFF
    b_hi, b_lo = b >> 16, b & 0xFFFF
    lo_lo = a_lo * b_lo
    mid = a_hi * b_lo + a_lo * b_hi + (lo_lo >> 16)
    return a_hi * b_hi + (mid >> 16), ((mid & 0xFFFF) << 16) | (lo_lo & 0xFFFF)


def _philox_words(seed: int, c0: torch.Tensor, c1: torch.Tensor, stream: int) -> torch.Tensor:
    """Philox4x32-10 (Triton's ``tl.philox``) at counters (c0, c1, stream, 0), int64 holding uint32, under the
    64-bit key ``seed``: the four output words, stacked in a last dim."""
    c = [c0, c1, torch.full_like(c0, stream), torch.zeros_like(c0)]
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    a, b = _PHILOX_ROUND
    for _ in range(10):
        hi_b, lo_b = _mul_wide(b, c[2])
        hi_a, lo_a = _mul_wide(a, c[0])
        c = [hi_b ^ c[1] ^ k0, lo_b, hi_a ^ c[3] ^ k1, lo_a]
        k0, k1 = (k0 + _PHILOX_KEY[0]) & _MASK32, (k1 + _PHILOX_KEY[1]) & _MASK32
    return torch.stack(c, dim=-1)


def _halves(words: torch.Tensor) -> torch.Tensor:
    """[..., 4] words -> [..., 8] draws: word j's high 16 bits, then its low 16 bits, times 2**-16."""
    halves = torch.stack([words >> 16, words & 0xFFFF], dim=-1).flatten(-2)
    return halves.to(torch.float32) * 2.0**-16


def philox_uniform(
    seed: int, stream: int, shape: tuple[int, ...], device: torch.device | str = "cpu", along_rows: bool = False
) -> torch.Tensor:
    """The draws the kernels round with over 2**16 (``mx_kernels.quantize.draws_tile``), fp32 of ``shape``,
    eight to a call of Philox4x32-10 (Triton's ``tl.philox``) under the 64-bit key ``seed``, each element
    taking half of output word (j div 2) for its place j in its eight: the high 16 bits for even j, the low
    16 bits for odd j, times 2**-16.

    By default element i (row-major) is place i mod 8 at counter (i div 8, its high word, ``stream``, 0); the
    last dim must be a multiple of 8. ``along_rows`` (a 2D shape [R, C], R a multiple of 8): element (r, c) is
    place r mod 8 at counter (r div 8, c, ``stream``, 0), eight rows of a column to a call (the NVFP4 kernel's
    draws along M, where each thread holds columns)."""
    if along_rows:
        if len(shape) != 2 or shape[0] % 8:
            raise ValueError(f"philox_uniform: along_rows takes a 2D shape of rows a multiple of 8, got {shape}")
        rows, cols = shape
        c0 = torch.arange(rows // 8, dtype=torch.int64)[:, None].expand(rows // 8, cols)
        c1 = torch.arange(cols, dtype=torch.int64)[None, :].expand(rows // 8, cols)
        draws = _halves(_philox_words(seed, c0.contiguous(), c1.contiguous(), stream))  # [R / 8, C, 8]
        return draws.permute(0, 2, 1).reshape(shape).to(device)
    if shape and shape[-1] % 8:
        raise ValueError(f"philox_uniform: the last dim of {shape} must be a multiple of 8")
    numel = 1
    for size in shape:
        numel *= size
    counter = torch.arange(numel // 8, dtype=torch.int64)
    return _halves(_philox_words(seed, counter & _MASK32, counter >> 32, stream)).reshape(shape).to(device)
