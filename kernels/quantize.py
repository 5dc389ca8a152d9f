"""Triton device functions: quantize 32-element MX blocks bit for bit as ``mx_recipe.formats.mx.to_mx``.

Every cast kernel loads a tile, arranges it as [R, 32] blocks along the quantized dim and
calls ``quantize_blocks``. All scale arithmetic is on integer bits (no log2, no division:
Triton's fp32 ``/`` is approximate), and 2**-e is built from bits, so the multiply by it is
exact like the reference's.
"""

import triton
import triton.language as tl
from mx_kernels.spec import ELEM_FORMATS

# A kernel takes its element format (ELEM: "e4m3" or "e5m2") and scale rule (RCEIL) as compile-time
# constants; these derive the rest of the format's constants from them at compile time.


@triton.constexpr_function
def fmt(elem, name):
    """An ElemFormat field of ``elem`` ("emax", "max_normal", ...) as a compile-time constant."""
    return getattr(ELEM_FORMATS[elem], name)


@triton.jit
def to_fp32(x, SOFTWARE_ROUND: tl.constexpr):
    """Widen a loaded bf16/fp32 tile to fp32. The interpreter's bf16 -> fp32 conversion mangles
    subnormals, so under SOFTWARE_ROUND the bf16 bits are moved into place by hand (exact)."""
    if SOFTWARE_ROUND and x.dtype == tl.bfloat16:
        return (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def scale_exponent(amax_bits, ELEM: tl.constexpr, RCEIL: tl.constexpr):
    """Unbiased shared exponent from the fp32 bits of amax >= 0, as ``formats.scale_exponent``."""
    EMAX: tl.constexpr = fmt(ELEM, "emax")
    MAX_MANT: tl.constexpr = fmt(ELEM, "max_mantissa_bits")
    biased = amax_bits >> 23  # the sign bit is clear
    if RCEIL:
        # amax / max_normal lies strictly above 2**e when amax's mantissa exceeds max_normal's: adding
        # 0x7FFFFF - MAX_MANT carries into the exponent exactly then (one add, not a mask, compare and add)
        e = ((amax_bits + (0x7FFFFF - MAX_MANT)) >> 23) - (127 + EMAX)
    else:
        e = biased - (127 + EMAX)
    e = tl.where(biased == 0xFF, 127, e)  # amax = inf (NaN: the caller's NaN scale wins)
    return tl.minimum(tl.maximum(e, -127), 127)


@triton.jit
def round_to_fp8_bits(v, ELEM: tl.constexpr):
    """fp32 v with |v| <= max_normal -> fp8 bits, round to nearest even, in integer arithmetic.

    For the Triton interpreter only, whose own fp8 conversion is wrong. v's 24-bit significand
    is shifted down to units of the target ulp at exponent k = max(exponent(v), EMIN), rounded
    half to even; code = ((k - EMIN) << MBITS) + n covers subnormals and the carry into the next
    binade (n = 2**(MBITS + 1) lands on the next exponent's first code).
    """
    MBITS: tl.constexpr = fmt(ELEM, "mbits")
    EMIN: tl.constexpr = fmt(ELEM, "emin")
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    biased = mag >> 23
    significand = tl.where(biased > 0, (mag & 0x7FFFFF) | 0x800000, mag & 0x7FFFFF)
    exp = tl.where(biased > 0, biased - 127, -126)
    k = tl.maximum(exp, EMIN)
    shift = tl.minimum(23 - MBITS + k - exp, 25)  # from 25 on, everything rounds to 0
    n = significand >> shift
    rem = significand & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    n += ((rem > half) | ((rem == half) & ((n & 1) == 1))).to(tl.int32)
    code = ((k - EMIN) << MBITS) + n
    return (code | sign).to(tl.uint8)


@triton.jit
def _max_propagating_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)  # max.NaN.f32: a NaN wins


@triton.jit
def max_abs(acc, v):
    """max(acc, |v|) elementwise, a NaN winning (FMNMX.NaN with an |.| operand: one instruction)."""
    return tl.maximum(acc, tl.abs(v), propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def block_amax_bits(blocks, AXIS: tl.constexpr, SOFTWARE_ROUND: tl.constexpr):
    """fp32 bits of each block's max |v| along AXIS, a NaN winning (its bits sort above inf's)."""
    if SOFTWARE_ROUND:
        # the interpreter runs a custom-combine reduce in Python: use the integer max of |bits|
        # (non-negative floats order like their bits, and a NaN sorts above inf)
        amax_bits = tl.max(blocks.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=AXIS)
    else:
        # max of |v| that propagates NaN: one FMNMX.NaN with |.| operands per element
        amax = tl.reduce(tl.abs(blocks), AXIS, _max_propagating_nan)
        amax_bits = amax.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    return amax_bits


@triton.jit
def scale_blocks(blocks, AXIS: tl.constexpr, ELEM: tl.constexpr, RCEIL: tl.constexpr, SOFTWARE_ROUND: tl.constexpr):
    """fp32 blocks of 32 along AXIS -> (NaN block?, shared exponent e, AXIS reduced away; blocks * 2**-e)."""
    amax_bits = block_amax_bits(blocks, AXIS, SOFTWARE_ROUND)
    e = scale_exponent(amax_bits, ELEM, RCEIL)
    # 2**-e from bits; -e = -127 is the one subnormal (0x00400000 = 2**-127)
    inv_scale = tl.where(e < 127, (127 - e) << 23, 0x400000).to(tl.float32, bitcast=True)
    return amax_bits > 0x7F800000, e, blocks * tl.expand_dims(inv_scale, AXIS)


@triton.jit
def quantize_blocks(
    blocks, AXIS: tl.constexpr, ELEM: tl.constexpr, RCEIL: tl.constexpr, SOFTWARE_ROUND: tl.constexpr, u=0.0,
    STOCHASTIC: tl.constexpr = False,
):  # fmt: skip
    """fp32 blocks of 32 along AXIS (the tile's whole extent there) -> (fp8 bits uint8, or e2m1 codes, same
    shape; biased E8M0 scales uint8, AXIS reduced away). The Triton kernels' one quantize routine. STOCHASTIC
    (e2m1 only): rounded with the 16-bit draws ``u`` (blocks' shape, ``round_e2m1``)."""
    tl.static_assert(ELEM == "e2m1" or not STOCHASTIC, "the fp8 casts round to nearest")
    MAX_NORMAL: tl.constexpr = fmt(ELEM, "max_normal")
    is_nan, e, v = scale_blocks(blocks, AXIS, ELEM, RCEIL, SOFTWARE_ROUND)
    if ELEM == "e2m1":  # 4-bit codes (saturating), packed by the caller; a NaN block's are 0, as the reference's
        q = tl.where(tl.expand_dims(is_nan, AXIS), 0, round_e2m1_codes(v, u, STOCHASTIC)).to(tl.uint8)
        return q, tl.where(is_nan, 0xFF, e + 127).to(tl.uint8)
    # clamp first: inf saturates, and the result does not depend on cvt's satfinite
    v = tl.minimum(tl.maximum(v, -MAX_NORMAL), MAX_NORMAL)
    if SOFTWARE_ROUND:
        q = round_to_fp8_bits(v, ELEM)
    elif ELEM == "e4m3":
        q = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)  # cvt.rn.satfinite.e4m3x2.f32
    else:
        q = v.to(tl.float8e5).to(tl.uint8, bitcast=True)  # cvt.rn.satfinite.e5m2x2.f32
    q = tl.where(tl.expand_dims(is_nan, AXIS), 0x7F, q).to(tl.uint8)
    scale = tl.where(is_nan, 0xFF, e + 127).to(tl.uint8)
    return q, scale


@triton.jit
def blocked_scale_offset(r, c, col_tiles):
    """Byte of scale (r, c) in the blocked layout (docs/DESIGN.md, Scale layout) of a matrix with
    ``col_tiles`` 4-column tiles."""
    tile = (r >> 7) * col_tiles + (c >> 2)
    return tile * 512 + (r & 31) * 16 + ((r >> 5) & 3) * 4 + (c & 3)


@triton.jit
def store_scales(s_ptr, scale, rows, cols, n_rows, n_cols, BLOCKED: tl.constexpr):
    """Store a [len(rows), len(cols)] tile of an [n_rows, n_cols] scale matrix, plain or blocked.

    Blocked: positions in the padding get zero, and the grid covers the padding, so every
    byte of the blocked buffer is written by some program."""
    valid = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    if BLOCKED:
        col_tiles = (n_cols + 3) >> 2
        offs = blocked_scale_offset(rows[:, None], cols[None, :], col_tiles)
        in_buffer = (rows < ((n_rows + 127) >> 7 << 7))[:, None] & (cols < col_tiles * 4)[None, :]
        tl.store(s_ptr + offs, tl.where(valid, scale, 0), mask=in_buffer)
    else:
        tl.store(s_ptr + rows.to(tl.int64)[:, None] * n_cols + cols[None, :], scale, mask=valid)


@triton.jit
def fp8_bits_to_fp32(q, ELEM: tl.constexpr, SOFTWARE_ROUND: tl.constexpr):
    """fp8 bits (uint8, not NaN) -> their fp32 value, exact. On the GPU the hardware conversion; under
    SOFTWARE_ROUND built from bits, which the interpreter computes exactly too."""
    MBITS: tl.constexpr = fmt(ELEM, "mbits")
    EMIN: tl.constexpr = fmt(ELEM, "emin")
    if SOFTWARE_ROUND:
        bits = q.to(tl.int32)
        exp_field = (bits >> MBITS) & ((1 << (7 - MBITS)) - 1)
        mant = bits & ((1 << MBITS) - 1)
        # |element| = (implicit one + mantissa) * 2**(max(exp_field, 1) - bias - MBITS), bias = 1 - EMIN
        significand = (mant + tl.where(exp_field > 0, 1 << MBITS, 0)).to(tl.float32)
        unit = ((tl.maximum(exp_field, 1) + EMIN - 1 - MBITS + 127) << 23).to(tl.float32, bitcast=True)
        # the sign goes in by bits: Triton's -x is 0 - x, which would turn -0 into +0
        element = ((significand * unit).to(tl.int32, bitcast=True) | ((bits & 0x80) << 24)).to(tl.float32, bitcast=True)
    elif ELEM == "e4m3":
        element = q.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        element = q.to(tl.float8e5, bitcast=True).to(tl.float32)
    return element


@triton.jit
def tile_rows(rows, src_ptr, M, GATHER: tl.constexpr):
    """(the rows of x that a tile's ``rows`` read, int64; which of them hold data). GATHER: ``rows`` index M
    laid-out rows (padded token groups), row r reading x's row src[r], -1 for a padding row (a zero row)."""
    if GATHER:
        src = tl.load(src_ptr + rows, mask=rows < M, other=-1)
        return src.to(tl.int64), src >= 0
    return rows.to(tl.int64), rows < M


@triton.jit
def butterfly_stage(v, H: tl.constexpr, ADD: tl.constexpr):
    """One stage of the fast Walsh-Hadamard transform along axis 1 of v [NB, N, C]: pairs at distance H
    become (a + b, a - b), as ``mx_recipe.formats.nvfp4._walsh_hadamard`` forms them; not ADD, the pairs only travel
    the stage's paths and come back to their places. Either way the compiler lays v out so that each pair
    meets in one thread."""
    NB: tl.constexpr = v.shape[0]
    N: tl.constexpr = v.shape[1]
    C: tl.constexpr = v.shape[2]
    v = tl.permute(tl.reshape(v, (NB, N // (2 * H), 2, H, C)), (0, 1, 3, 4, 2))
    a, b = tl.split(v)
    if ADD:
        a, b = a + b, a - b
    v = tl.permute(tl.join(a, b), (0, 1, 4, 2, 3))
    return tl.reshape(v, (NB, N, C))


@triton.jit
def column_blocks(x, N: tl.constexpr):
    """x [R, C] -> its blocks of N rows, [R // N, N, C], laid out so that each thread holds whole columns of
    blocks: the values travel the paths of the transform's stages at every distance below N, without its
    arithmetic. As loaded, a tile's rows lie across threads, and a reduction over a block's rows costs warp
    shuffles and shared-memory round trips (the along-M fake-quants: 18 to 36 shuffles a tile)."""
    tl.static_assert((N == 16) or (N == 32), "blocks of 16 (NVFP4) or 32 (MX)")
    v = tl.reshape(x, (x.shape[0] // N, N, x.shape[1]))
    v = butterfly_stage(v, 1, False)
    v = butterfly_stage(v, 2, False)
    v = butterfly_stage(v, 4, False)
    v = butterfly_stage(v, 8, False)
    if N == 32:
        v = butterfly_stage(v, 16, False)
    return v


# Philox4x32's two round multipliers, each a full 32 x 32 -> 64-bit product in one instruction (IMAD.WIDE.U32):
# Triton's tl.philox forms the high and low words apart (umulhi, then mul), two IMADs a product
_PHILOX_MUL_A = tl.constexpr("{\n.reg .b64 t;\nmul.wide.u32 t, $2, 0xD2511F53;\nmov.b64 {$1, $0}, t;\n}")
_PHILOX_MUL_B = tl.constexpr("{\n.reg .b64 t;\nmul.wide.u32 t, $2, 0xCD9E8D57;\nmov.b64 {$1, $0}, t;\n}")


@triton.jit
def _mul_wide(a, ASM: tl.constexpr):
    """(high, low) words of a * the multiplier of ``ASM`` (uint32)."""
    return tl.inline_asm_elementwise(ASM, "=r,=r,r", [a], dtype=(tl.uint32, tl.uint32), is_pure=True, pack=1)


@triton.jit
def philox(seed, c0, c1, c2, c3, WIDE: tl.constexpr):
    """Philox4x32-10 of counter (c0, c1, c2, c3) (uint32) under the 64-bit key ``seed``: ``tl.philox``, bit for bit.
    WIDE (the GPU): each round's two products in one wide multiply each, 20 IMADs a call instead of 35 (sm_90
    SASS); else ``tl.philox`` itself (the interpreter runs no inline PTX)."""
    if WIDE:
        key = seed.to(tl.uint64)
        k0 = (key & 0xFFFFFFFF).to(tl.uint32)
        k1 = ((key >> 32) & 0xFFFFFFFF).to(tl.uint32)
        for _ in tl.static_range(10):
            hi_b, lo_b = _mul_wide(c2, _PHILOX_MUL_B)
            hi_a, lo_a = _mul_wide(c0, _PHILOX_MUL_A)
            c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
            k0 = tl.add(k0, 0x9E3779B9, sanitize_overflow=False)
            k1 = tl.add(k1, 0xBB67AE85, sanitize_overflow=False)
        r0, r1, r2, r3 = c0, c1, c2, c3
    else:
        r0, r1, r2, r3 = tl.philox(seed, c0, c1, c2, c3)
    return r0, r1, r2, r3


@triton.jit
def draws_tile(seed, stream, rows, col0, K, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, WIDE: tl.constexpr):
    """The stochastic-rounding draws of the tile [rows, col0 + BLOCK_K) of an output [.., K], 16-bit integers
    (int32): the element of row-major index i takes half a word of Philox4x32-10 at counter (i div 8, i's high
    word, ``stream``, 0) under the 64-bit key ``seed``, output word (i mod 8) div 2, its high 16 bits for even i
    and its low 16 bits for odd i (``mx_recipe.formats.philox.philox_uniform`` is the draw over 2**16). ``rows``: the
    tile's row indices in the output (int); col0 and K are multiples of 8. WIDE: ``philox``'s."""
    first = rows.to(tl.int64)[:, None] * K + (col0 + 8 * tl.arange(0, BLOCK_K // 8))[None, :]  # [BM, BK/8]
    counter = first >> 3
    zero = tl.zeros_like(counter).to(tl.uint32)
    r0, r1, r2, r3 = philox(seed, counter.to(tl.uint32), (counter >> 32).to(tl.uint32), zero + stream, zero, WIDE)
    # [.., word // 2, word % 2, half]: row-major, element 2 * word + half, the high half first
    high = tl.join(tl.join(r0 >> 16, r2 >> 16), tl.join(r1 >> 16, r3 >> 16))
    low = tl.join(tl.join(r0 & 0xFFFF, r2 & 0xFFFF), tl.join(r1 & 0xFFFF, r3 & 0xFFFF))
    return tl.reshape(tl.join(high, low), (BLOCK_M, BLOCK_K)).to(tl.int32)


@triton.jit
def draws_tile_along_rows(seed, stream, row0, cols, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, WIDE: tl.constexpr):
    """The draws of the tile [row0, row0 + BLOCK_M) x ``cols`` (int, [BLOCK_K]) of an output quantized along
    its rows, [BLOCK_M // 8, 8, BLOCK_K], 16-bit integers: element (r, c) is place r mod 8 of the Philox4x32-10
    call at counter (r div 8, c, ``stream``, 0) under the 64-bit key ``seed``, half of output word (r mod 8)
    div 2, the high 16 bits for even r (``mx_recipe.formats.philox.philox_uniform`` with along_rows). A column's eight
    rows share a call, so a thread that holds a column draws its own, without moving draws between threads.
    row0: a multiple of 8. WIDE: ``philox``'s."""
    zero = tl.zeros((BLOCK_M // 8, 1, BLOCK_K), tl.uint32)
    groups = (row0 // 8 + tl.arange(0, BLOCK_M // 8)).to(tl.uint32)[:, None, None]  # [BM / 8, 1, 1]
    r0, r1, r2, r3 = philox(seed, groups + zero, cols.to(tl.uint32)[None, None, :] + zero, zero + stream, zero, WIDE)
    place = tl.arange(0, 8)[None, :, None]  # [1, 8, 1]
    word = tl.where(place < 4, tl.where(place < 2, r0, r1), tl.where(place < 6, r2, r3))
    return tl.where(place % 2 == 0, word >> 16, word & 0xFFFF).to(tl.int32)


@triton.jit
def round_e2m1(v, draw, STOCHASTIC: tl.constexpr):
    """fp32 v -> the nearest e2m1 value as fp32, ties to even, saturating at +-6, the sign kept (-0 too):
    ``formats.round_to_format`` for e2m1, bit for bit. STOCHASTIC: rounded with the 16-bit draws ``draw``
    (int32, v's shape) as ``formats.round_to_format_stochastic`` rounds with draw / 2**16: the draw goes in
    below the kept mantissa bit and the carry out of the dropped bits rounds up (Blackwell's cvt.rs rule).
    Every step is exact fp32 or integer arithmetic, or a single correctly rounded fp32 add, so the GPU and
    the interpreter agree. NaN gives some value: callers mask NaN blocks."""
    bits = v.to(tl.int32, bitcast=True)
    mag = tl.minimum((bits & 0x7FFFFFFF).to(tl.float32, bitcast=True), 6.0)
    if STOCHASTIC:
        # one mantissa bit is kept in every binade from 1 up; below 1 the grid's spacing is 0.5, which is
        # the kept bit of [1, 2) once 1 is added. No conversions: they issue at a quarter of the fp32 rate.
        offset = tl.where(mag < 1.0, 1.0, 0.0)
        carried = (mag + offset).to(tl.int32, bitcast=True) + (draw << 6)  # the draw's 16 bits atop the 22 dropped
        q = (carried & -0x400000).to(tl.float32, bitcast=True) - offset
    else:
        # the grid's spacing in |v|'s binade is half its power of two: 0.5 below 2 (subnormals share it),
        # 1 in [2, 4), 2 in [4, 6]. spacing * 2**23 has an fp32 ulp of one spacing over [it, 2x it), which
        # holds it + |v|: the add rounds |v| to the grid, ties to even (an even multiple of the spacing),
        # and the subtraction is exact
        binade = tl.maximum(mag.to(tl.int32, bitcast=True) & 0x7F800000, 0x3F800000)
        magic = (binade + (22 << 23)).to(tl.float32, bitcast=True)
        q = (mag + magic) - magic
    return (q.to(tl.int32, bitcast=True) | (bits & -0x80000000)).to(tl.float32, bitcast=True)


@triton.jit
def round_e2m1_codes(v, draw, STOCHASTIC: tl.constexpr):
    """fp32 v -> the 4-bit code (int32, the sign in bit 3) of ``round_e2m1(v, draw, STOCHASTIC)``, read off the
    rounding's own bits instead of encoding its result (``formats._encode_e2m1``). To nearest, |v| + magic holds
    the rounded |v| in units of its binade's spacing in its low mantissa bits, k, and the code is k + 2e for the
    binade 2**e (e = 0 below 2). Stochastically, the carried bits above the 22 dropped ones are the value's
    exponent and kept bit: from 1 up the code is those bits less 252 (1.0 is 0x3F8 << 20: code 2, 1.5 code 3, and
    so on), below 1 less 254 for the 1 added. NaN gives some code: callers mask NaN blocks."""
    bits = v.to(tl.int32, bitcast=True)
    mag = tl.minimum((bits & 0x7FFFFFFF).to(tl.float32, bitcast=True), 6.0)
    if STOCHASTIC:
        below_one = mag < 1.0
        carried = (mag + tl.where(below_one, 1.0, 0.0)).to(tl.int32, bitcast=True) + (draw << 6)
        code = (carried >> 22) - tl.where(below_one, 254, 252)
    else:
        binade = tl.maximum(mag.to(tl.int32, bitcast=True) & 0x7F800000, 0x3F800000)
        magic = (binade + (22 << 23)).to(tl.float32, bitcast=True)
        code = ((mag + magic).to(tl.int32, bitcast=True) & 7) + ((binade >> 22) - 254)
    return code | ((bits >> 28) & 8)


def _e2m1_codes_ptx(src: str, dst: str) -> str:
    """PTX: the two bf16 of register ``src`` -> their e2m1 codes in the 16-bit halves of ``dst``, rounded to
    nearest even as ``round_e2m1_codes``: |v| (saturated at 6) plus a power-of-two magic whose bf16 ulp is the
    grid's spacing in |v|'s binade (binade * 2**6: 0.5 below 2, 1 in [2, 4), 2 from 4), added in packed bf16
    (``add.rn.bf16x2``, sm_90), leaves the rounded |v| in spacings, k, in the sum's low mantissa bits; the code
    is k + 2e for the binade 2**e (e = 0 below 2). Integer steps work on both halves at once: no carry crosses."""
    return f"""
        and.b32 mag, {src}, 0x7FFF7FFF;
        min.bf16x2 mag, mag, six;
        and.b32 binade, mag, 0x7F807F80;
        max.u16x2 binade, binade, one;
        add.u32 sum, binade, 0x03000300;
        add.rn.bf16x2 sum, mag, sum;
        and.b32 sum, sum, 0x00070007;
        shr.u32 binade, binade, 6;
        add.u32 sum, sum, binade;
        sub.u32 sum, sum, 0x00FE00FE;
        shr.u32 sign, {src}, 12;
        and.b32 sign, sign, 0x00080008;
        or.b32 {dst}, sum, sign;"""


def _codes_ptx_block(registers: str, body: str) -> str:
    """A PTX block around ``body``: the registers of ``_e2m1_codes_ptx`` and ``registers`` declared, its constants
    6.0 and 1.0 set in both halves."""
    return (
        f"{{\n.reg .b32 mag, binade, sum, sign, six, one, {registers};"
        f"\nmov.b32 six, 0x40C040C0;\nmov.b32 one, 0x3F803F80;{body}\n}}"
    )


def _words_along_k_ptx() -> str:
    """PTX of ``e2m1_words_along_k``'s rounding: words $1..$4 times scales $5..$8 -> the four bytes of $0."""
    body = "".join(
        f"\nmul.rn.bf16x2 v{k}, ${1 + k}, ${5 + k};" + _e2m1_codes_ptx(f"v{k}", f"c{k}")
        + f"\nshr.u32 t, c{k}, 12;\nor.b32 c{k}, c{k}, t;\nand.b32 c{k}, c{k}, 0xFF;"  # the high half's code atop
        for k in range(4)
    )  # fmt: skip
    pack = "\nmad.lo.u32 c0, c1, 256, c0;\nmad.lo.u32 c2, c3, 256, c2;\nmad.lo.u32 $0, c2, 65536, c0;"
    return _codes_ptx_block("t, v0, v1, v2, v3, c0, c1, c2, c3", body + pack)


_WORDS_ALONG_K_PTX = tl.constexpr(_words_along_k_ptx())


@triton.jit
def max_u16x2(a, b):
    """max of two words' 16-bit halves, each half on its own (non-negative bf16 order like their bits)."""
    return tl.inline_asm_elementwise("max.u16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def bf16_block_scales(amax, RCEIL: tl.constexpr):
    """e2m1 blocks' max |x| as bf16 bits (int32, non-negative) -> (NaN block?, bf16 bits of 2**-e, 2**-127 being
    the subnormal 0x0040; the biased scale byte): ``scale_exponent`` for the word paths."""
    is_nan = amax > 0x7F80
    e = scale_exponent(amax << 16, "e2m1", RCEIL)
    inv = tl.where(e < 127, (127 - e) << 7, 0x40)
    return is_nan, inv, tl.where(is_nan, 0xFF, e + 127).to(tl.uint8)


@triton.jit
def e2m1_words_along_k(w, RCEIL: tl.constexpr):
    """MXFP4 along K of bf16 x read as int32 words, two elements each, without widening it: w [R, C / 2] ->
    (packed codes [R, C / 2] uint8, element 2i in the low nibble; biased scales [R, C / 32]), bit for bit
    ``to_mx``. Each block of 16 words takes its maximum in both halves at once (``max.u16x2``; non-negative
    bf16 order like their bits, NaN above inf), is scaled by its power of two in packed bf16 (exact: x * 2**-e
    is bf16; below bf16's normals it only reaches code 0) and rounded as ``_e2m1_codes_ptx``. GPU only."""
    R: tl.constexpr = w.shape[0]
    CW: tl.constexpr = w.shape[1]
    blocks = tl.reshape(w, (R * CW // 16, 16))
    amax = tl.reduce(blocks & 0x7FFF7FFF, 1, max_u16x2)
    amax = tl.maximum(amax & 0xFFFF, amax >> 16)  # the block's max |x|, bf16 bits
    is_nan, inv, scale = bf16_block_scales(amax, RCEIL)
    codes = tl.inline_asm_elementwise(_WORDS_ALONG_K_PTX, "=r,r,r,r,r,r,r,r,r", [blocks, (inv * 0x10001)[:, None]],
                                      dtype=tl.uint8, is_pure=True, pack=4)  # fmt: skip
    codes = tl.where(is_nan[:, None], 0, codes)
    return tl.reshape(codes, (R, CW)), tl.reshape(scale, (R, CW // 16))


def _word_codes_ptx() -> str:
    """PTX of ``e2m1_words_along_m``'s rounding: word $1 times scales $2 -> the two codes in the halves of $0."""
    return _codes_ptx_block("v", "\nmul.rn.bf16x2 v, $1, $2;" + _e2m1_codes_ptx("v", "$0"))


WORD_CODES_PTX = tl.constexpr(_word_codes_ptx())


@triton.jit
def e2m1_words_along_m(w, RCEIL: tl.constexpr, MOVE: tl.constexpr):
    """MXFP4 along M of bf16 x read as int32 words (two columns each): w [R, C / 2] (R a multiple of 32) ->
    (packed codes [C, R / 2] uint8, the transposed tile: row c holds column c's codes, row 2i in the low nibble;
    biased scales [C, R / 32]), bit for bit ``to_mx`` of the transpose. Each thread must hold whole blocks of a
    column of words: as loaded, or (MOVE) moved there through shared memory (``column_blocks``). A word's
    maxima, scaling and rounding then serve its two columns at once (``e2m1_words_along_k``'s steps), and the
    codes of rows 2i and 2i + 1, in two words of one thread, meet in one byte per column. GPU only."""
    R: tl.constexpr = w.shape[0]
    CW: tl.constexpr = w.shape[1]
    NB: tl.constexpr = R // 32
    cw = column_blocks(w, 32) if MOVE else tl.reshape(w, (NB, 32, CW))  # [NB, 32, CW]
    amax = tl.reduce(cw & 0x7FFF7FFF, 1, max_u16x2)  # [NB, CW]: column 2j's max |x| in the low half, 2j + 1's high
    amax = tl.reshape(tl.join(amax & 0xFFFF, amax >> 16), (NB, 2 * CW))  # bf16 bits, column order
    is_nan, inv, scale = bf16_block_scales(amax, RCEIL)
    inv_lo, inv_hi = tl.split(tl.reshape(inv, (NB, CW, 2)))
    keep_lo, keep_hi = tl.split(tl.reshape(tl.where(is_nan, 0, 0xFFFF), (NB, CW, 2)))  # a NaN block's codes are 0
    codes = tl.inline_asm_elementwise(WORD_CODES_PTX, "=r,r,r", [cw, (inv_lo | (inv_hi << 16))[:, None, :]],
                                      dtype=tl.int32, is_pure=True, pack=1)  # fmt: skip
    codes = codes & (keep_lo | (keep_hi << 16))[:, None, :]
    even, odd = tl.split(tl.permute(tl.reshape(codes, (NB, 16, 2, CW)), (0, 1, 3, 2)))
    pairs = even | (odd << 4)  # [NB, 16, CW]: column 2j's byte of rows 2i, 2i + 1 in bits 0-7, column 2j + 1's in 16-23
    pairs = tl.reshape(tl.join(pairs & 0xFF, (pairs >> 16) & 0xFF), (NB * 16, 2 * CW))
    return tl.trans(pairs).to(tl.uint8), tl.trans(scale)


@triton.jit
def pack_pairs(codes):
    """[R, C] codes -> [R, C / 2] bytes, element 2i in the low nibble (``formats.pack_fp4``)."""
    lo, hi = tl.split(tl.reshape(codes, (codes.shape[0], codes.shape[1] // 2, 2)))
    return (lo | (hi << 4)).to(tl.uint8)


@triton.jit
def pack_pairs_along_rows(codes):
    """[R, C] codes -> [R / 2, C] bytes, row 2i in the low nibble: what ``pack_pairs`` gives for the transpose,
    left untransposed."""
    rows_in_pairs = tl.reshape(tl.permute(tl.reshape(codes, (codes.shape[0] // 2, 2, codes.shape[1])), (0, 2, 1)),
                               (codes.shape[0] // 2, 2 * codes.shape[1]))  # fmt: skip
    return pack_pairs(rows_in_pairs)


@triton.jit
def dequantize_blocks(q, scale, AXIS: tl.constexpr, ELEM: tl.constexpr, SOFTWARE_ROUND: tl.constexpr):
    """fp8 bits (uint8) and biased scales -> fp32 element * 2**(scale - 127), NaN where the scale
    is 0xFF: ``MXTensor.dequantize`` in fp32. On the GPU the element comes from the hardware fp8
    conversion (exact; one cvt per two elements: the fake-quant kernels are ALU-bound otherwise).
    Under SOFTWARE_ROUND it is built from bits, which the interpreter computes exactly too."""
    element = fp8_bits_to_fp32(q, ELEM, SOFTWARE_ROUND)
    s = scale.to(tl.int32)
    factor = tl.where(s > 0, s << 23, 0x400000).to(tl.float32, bitcast=True)  # 2**(s - 127); s = 0: 2**-127
    factor = tl.where(s == 0xFF, float("nan"), factor)  # element * NaN is NaN, zeros included
    return element * tl.expand_dims(factor, AXIS)


@triton.jit
def fake_quant_blocks(
    blocks, AXIS: tl.constexpr, ELEM: tl.constexpr, RCEIL: tl.constexpr, SOFTWARE_ROUND: tl.constexpr,
    OUT_BF16_BITS: tl.constexpr, u, STOCHASTIC: tl.constexpr,
):  # fmt: skip
    """fp32 blocks of 32 along AXIS -> their MX quantize-dequantize, same shape: fp32, or bf16 bits
    (int16) under OUT_BF16_BITS (the interpreter, whose bf16 store is not trusted). STOCHASTIC (e2m1 only):
    rounded with the 16-bit draws ``u`` (blocks' shape, ``round_e2m1``)."""
    if ELEM == "e2m1":
        v = fake_quant_e2m1_blocks(blocks, AXIS, RCEIL, SOFTWARE_ROUND, u, STOCHASTIC)
    else:
        tl.static_assert(not STOCHASTIC, "the fp8 fake-quant kernels round to nearest")
        q, scale = quantize_blocks(blocks, AXIS, ELEM, RCEIL, SOFTWARE_ROUND)
        v = dequantize_blocks(q, scale, AXIS, ELEM, SOFTWARE_ROUND)
    if OUT_BF16_BITS:
        v = bf16_bits_rne(v)
    return v


@triton.jit
def fake_quant_e2m1_blocks(
    blocks, AXIS: tl.constexpr, RCEIL: tl.constexpr, SOFTWARE_ROUND: tl.constexpr, u, STOCHASTIC: tl.constexpr,
):  # fmt: skip
    """fp32 blocks of 32 along AXIS -> their MXFP4 quantize-dequantize in fp32: ``formats.fake_quant`` for e2m1,
    to nearest or (STOCHASTIC) with the 16-bit draws ``u``. The e2m1 value times 2**e directly: no packed codes, no
    e8m0 byte (e2m1 * 2**e is exact in fp32 and bf16)."""
    is_nan, e, v = scale_blocks(blocks, AXIS, "e2m1", RCEIL, SOFTWARE_ROUND)
    factor = tl.where(e > -127, (e + 127) << 23, 0x400000).to(tl.float32, bitcast=True)  # 2**e
    factor = tl.where(is_nan, float("nan"), factor)
    q = round_e2m1(v, u, STOCHASTIC)
    return q * tl.expand_dims(factor, AXIS)


@triton.jit
def bf16_bits_rne(v):
    """fp32 -> bf16 bits (int16), round to nearest even, NaN kept NaN. For the interpreter, whose
    own bf16 conversion is not trusted here; the GPU converts with cvt.rn.bf16.f32."""
    bits = v.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
    return tl.where(is_nan, 0x7FC0, rounded).to(tl.int16)
