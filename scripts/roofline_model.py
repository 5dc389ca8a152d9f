"""A roofline model of one MX training step against the bf16 step (docs/DESIGN.md, "The MX linear: three
GEMMs, six casts").

Every GEMM and every cast is one op; an op takes max(FLOPs / dense peak of its format,
bytes / memory bandwidth), and a step is the sum of its ops: nothing overlaps (a cast never
hides under a GEMM). For ``y = x @ w.T`` (x [M, K], w [N, K], upstream gradient g [M, N])
the bf16 step is three bf16 GEMMs; the MX step adds the casts its three GEMMs need:

    forward      y  = x @ w.T   x dim0, w dim0
    grad input   gx = g @ w     g dim0, w dim1
    grad weight  gw = g.T @ x   g dim1, x dim1

A cast reads bf16 (2 B/elem) and writes qdata (1 B fp8, 0.5 B fp4) and scales (1 B per 32);
a fused dim0+dim1 cast reads once and writes both; a fake-quant cast writes the dequantized bf16.
An NVFP4 recipe (``NVFP4Recipe``) is modeled as e2m1 operands with one e4m3 scale per 16 elements,
plus one more read of each cast tensor for its per-tensor maximum (the Hadamard transform and the
stochastic rounding are arithmetic, free at these intensities).
``MXPath`` says how the GEMMs run: natively (sm_100: the block-scaled GEMM at the fp8/fp4 rate) or
emulated (Hopper has no MX GEMM: the bf16 rate, after dequantizing each operand to bf16 in memory
unless that is fused into the GEMM or the casts write bf16 themselves).

MoE expert weights [E, N, K] are one grouped GEMM over M = tokens * top_k routed rows (each
expert sees top_k / E of the tokens on average); the whole 3D weight is read and cast.

Nothing here needs a GPU: models are built on the meta device to enumerate their GEMMs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from mx_recipe.formats.recipe import HIGH_PRECISION, MXRecipe, NVFP4Recipe

BF16_BYTES = 2.0
NVFP4 = "nvfp4"  # the operand format of every GEMM of an NVFP4 recipe
ELEM_BYTES = {"e4m3": 1.0, "e5m2": 1.0, "e2m1": 0.5, NVFP4: 0.5}
SCALE_BYTES = 1 / 32  # one E8M0 byte per 32 elements
NVFP4_SCALE_BYTES = 1 / 16  # one e4m3 byte per 16 elements
FP4_ELEMS = ("e2m1", NVFP4)
BLOCK = 32


@dataclass(frozen=True)
class Device:
    """Dense (no sparsity) tensor-core peaks in FLOP/s and memory bandwidth in B/s (read + write)."""

    name: str
    bf16_flops: float
    fp8_flops: float
    fp4_flops: float | None  # None: no fp4 tensor cores
    mem_bw: float  # datasheet
    copy_bw: float | None  # a measured device-to-device copy, where one exists
    native_mx: bool  # a block-scaled (MX) GEMM in hardware
    source: str

    def rate(self, fmt: str) -> float:
        rates = {"bf16": self.bf16_flops, "fp8": self.fp8_flops, "fp4": self.fp4_flops}
        if rates.get(fmt) is None:
            raise ValueError(f"{self.name} has no {fmt} tensor-core rate")
        return rates[fmt]

    def measured(self) -> Device:
        """The same device with its measured copy bandwidth in place of the datasheet's."""
        if self.copy_bw is None:
            raise ValueError(f"{self.name}: no measured copy bandwidth")
        return replace(self, name=f"{self.name} (measured copy bw)", mem_bw=self.copy_bw)

    def derated(self, eff: Efficiency) -> Device:
        """Rates scaled by achieved fractions of peak (a what-if, not a measurement of this device)."""
        fp4 = None if self.fp4_flops is None else self.fp4_flops * eff.gemm_mx
        return replace(
            self,
            name=f"{self.name} ({eff.name})",
            bf16_flops=self.bf16_flops * eff.gemm_bf16,
            fp8_flops=self.fp8_flops * eff.gemm_mx,
            fp4_flops=fp4,
            mem_bw=self.mem_bw * eff.memory,
        )


@dataclass(frozen=True)
class Efficiency:
    name: str
    gemm_bf16: float
    gemm_mx: float
    memory: float


DEVICES: dict[str, Device] = {
    "b200": Device(
        "B200", 2.25e15, 4.5e15, 9.0e15, 8.0e12, None, True,
        "NVIDIA Blackwell architecture brief pp. 19-20, as quoted by the torchao MX performance tracker "
        "(its GEMM table says 4.25 PF fp8; its e2e section and the 2x-of-bf16 rule say 4.5 PF)",
    ),
    "h100": Device(
        "H100 SXM", 989e12, 1979e12, None, 3.35e12, 3.0e12, False,
        "H100 SXM datasheet (dense); copy ~3.0 TB/s measured on an H100 80GB HBM3 (docs/DESIGN.md, Hardware facts)",
    ),
    "h200": Device(
        "H200", 989e12, 1979e12, None, 4.8e12, 4.225e12, False,
        "H200 datasheet (dense, same tensor cores as H100 SXM); copy 4225 GB/s measured "
        "(docs/DESIGN.md, Hardware facts)",
    ),
}  # fmt: skip

# Fractions of peak reached on an H200 (docs/DESIGN.md, Hardware facts; docs/PERFORMANCE.md): bf16 GEMM 740-770 of
# 989 TF/s, fp8 tensorwise GEMM 1296 of 1979, our dim0 cast 3811 of 4800 GB/s. Applied to B200 as a guess.
H200_ACHIEVED = Efficiency("H200-achieved fractions", 755 / 989, 1296 / 1979, 3811 / 4800)


@dataclass(frozen=True)
class MXPath:
    """How the MX step runs its GEMMs and casts."""

    name: str
    native_gemm: bool  # block-scaled GEMM at the fp8/fp4 rate; else emulated at the bf16 rate
    fused_casts: bool  # a tensor needed along both dims is read once (cast_dim0_dim1)
    dequant_passes: bool  # emulated: each operand dequantized to bf16 in memory before the GEMM
    group_pad_copy: bool  # MoE grad weight: g and x copied into 32-row padded groups first
    description: str
    fake_quant: bool = False  # emulated: the cast itself writes the dequantized bf16 (no MX copy in memory)
    # the upstream gradient g read once for both of its casts in the linear's backward (not for
    # grouped GEMMs, whose along-M cast works per token group)
    fused_grad_cast: bool = False
    # a linear's x read once for both of its casts in forward (fuse_x_casts; on by default)
    fused_x_cast: bool = False


PATHS: dict[str, MXPath] = {
    p.name: p
    for p in (
        MXPath("native", True, False, False, True, "sm_100 MX GEMM; separate dim0/dim1 casts, group padding copy"),
        MXPath("native_fused", True, True, False, False, "sm_100 MX GEMM; fused dim0+dim1 casts, no padding copy"),
        MXPath("emulated", False, False, True, True, "bf16-rate GEMM after dequantize passes"),
        MXPath("emulated_fused", False, False, False, True, "bf16-rate GEMM with the dequantize fused into it"),
        MXPath(
            "fake_quant",
            False,
            False,
            False,
            False,
            "casts write dequantized bf16 (a linear's x and g: both in one read), MoE groups unpadded; bf16-rate GEMM",
            fake_quant=True,
            fused_grad_cast=True,
            fused_x_cast=True,
        ),
    )
}
# linear.py and grouped.py run the emulated backend through fake-quant kernels (mx_recipe.ops.mx_cast: one
# read of bf16, one write of the dequantized bf16 per result), on every device. dim0 and dim1 are
# separate kernels except for a linear's x and g (fake_quant_dim0_dim1); the MoE grad-weight casts
# quantize each token group in place (fake_quant_groups_along_m), so its GEMM runs over the unpadded
# rows. Not modeled: the recipe option fuse_expert_casts (on by default), and an input shared by
# several linears (wq, wk, wv) cast once for all of them (the model is per linear).
OURS_TODAY = "fake_quant"


@dataclass(frozen=True)
class Op:
    name: str
    flops: float
    bytes: float
    fmt: str | None  # tensor-core format of a GEMM ("bf16", "fp8", "fp4"); None: memory only

    def compute_s(self, dev: Device) -> float:
        return 0.0 if self.fmt is None else self.flops / dev.rate(self.fmt)

    def memory_s(self, dev: Device) -> float:
        return self.bytes / dev.mem_bw

    def time(self, dev: Device) -> float:
        return max(self.compute_s(dev), self.memory_s(dev))

    def bound(self, dev: Device) -> str:
        return "compute" if self.compute_s(dev) >= self.memory_s(dev) else "memory"


def mx_bytes(elem: str) -> float:
    """Bytes per element of an MX (or NVFP4) tensor: qdata plus its share of the scales."""
    return ELEM_BYTES[elem] + (NVFP4_SCALE_BYTES if elem == NVFP4 else SCALE_BYTES)


def cast_op(name: str, numel: float, elem: str, fused: bool = False) -> Op:
    """bf16 -> MX: read the input once, write one (or, fused, two) MX copies."""
    return Op(name, 0.0, numel * (BF16_BYTES + (2 if fused else 1) * mx_bytes(elem)), None)


def fake_quant_op(name: str, numel: float, *written: float) -> Op:
    """A fake-quant cast: read ``numel`` bf16 elements once, write each result (numel given) as
    dequantized bf16. An along-M result may have more rows than the input: the zero padding."""
    return Op(name, 0.0, (numel + sum(written)) * BF16_BYTES, None)


def dequant_op(name: str, numel: float, elem: str) -> Op:
    """MX -> bf16 in memory (the emulated GEMM's prologue when it is not fused)."""
    return Op(name, 0.0, numel * (mx_bytes(elem) + BF16_BYTES), None)


def gemm_op(name: str, flops: float, a: tuple[float, float], b: tuple[float, float], out_numel: float, fmt: str) -> Op:
    """A GEMM reading operands a and b, given as (numel, bytes per element), and writing a bf16 result."""
    return Op(name, flops, a[0] * a[1] + b[0] * b[1] + out_numel * BF16_BYTES, fmt)


@dataclass(frozen=True)
class Gemm:
    """One linear (groups=1) or one grouped expert GEMM: y = x @ w.T with x [m, k] (m rows over all
    groups), w [groups * n, k] (an [E, N, K] expert weight), g [m, n]."""

    name: str
    m: int
    k: int
    n: int
    groups: int = 1
    mx: bool = True  # False: left in bf16 by convert_to_mx (skip patterns, features not multiples of 32)

    @property
    def flops(self) -> float:
        return 3 * 2.0 * self.m * self.k * self.n  # forward, grad input, grad weight

    def shape_str(self) -> str:
        if self.groups == 1:
            return f"{self.m}x{self.k}x{self.n}"
        return f"{self.groups}x({self.m / self.groups:g})x{self.k}x{self.n}"


def _three_gemms(g: Gemm, m_gw: int) -> list[tuple[str, float, float, float, float]]:
    """(name, FLOPs, numel of a, numel of b, numel of the output) of forward, grad input, grad weight.
    The grad-weight GEMM runs over m_gw rows (M padded to blocks of 32 for MX); per group for experts."""
    x, w, gr = g.m * g.k, g.groups * g.n * g.k, g.m * g.n
    flops = 2.0 * g.m * g.k * g.n
    return [
        ("forward GEMM", flops, x, w, gr),  # y = x @ w.T
        ("grad-input GEMM", flops, gr, w, x),  # gx = g @ w
        ("grad-weight GEMM", 2.0 * m_gw * g.k * g.n, m_gw * g.n, m_gw * g.k, w),  # gw = g.T @ x
    ]


def bf16_ops(g: Gemm) -> list[Op]:
    """The three GEMMs of the bf16 step (nothing to cast)."""
    return [
        gemm_op(name, flops, (a, BF16_BYTES), (b, BF16_BYTES), out, "bf16")
        for name, flops, a, b, out in _three_gemms(g, g.m)
    ]


def _mx_gemm(name: str, flops: float, a: tuple[float, str], b: tuple[float, str], out: float, path: MXPath) -> list[Op]:
    """One GEMM of the MX step, operands given as (numel, element format); bf16 if either stays bf16."""
    (a_numel, a_elem), (b_numel, b_elem) = a, b
    if HIGH_PRECISION in (a_elem, b_elem):
        return [gemm_op(name, flops, (a_numel, BF16_BYTES), (b_numel, BF16_BYTES), out, "bf16")]
    a_mx, b_mx = (a_numel, mx_bytes(a_elem)), (b_numel, mx_bytes(b_elem))
    if path.native_gemm:
        fmt = "fp4" if a_elem in FP4_ELEMS and b_elem in FP4_ELEMS else "fp8"  # fp4 x fp8 runs at the fp8 rate
        return [gemm_op(name, flops, a_mx, b_mx, out, fmt)]
    if path.fake_quant:  # the operands are already dequantized bf16
        return [gemm_op(name, flops, (a_numel, BF16_BYTES), (b_numel, BF16_BYTES), out, "bf16")]
    if not path.dequant_passes:
        return [gemm_op(name, flops, a_mx, b_mx, out, "bf16")]
    short = name.removesuffix(" GEMM")
    return [
        dequant_op(f"dequantize {short} a", a_numel, a_elem),
        dequant_op(f"dequantize {short} b", b_numel, b_elem),
        gemm_op(name, flops, (a_numel, BF16_BYTES), (b_numel, BF16_BYTES), out, "bf16"),
    ]


def _formats(recipe: MXRecipe | NVFP4Recipe) -> tuple[str, str, str, str, str]:
    """(forward, grad input, grad weight, g in grad input, g in grad weight) operand formats."""
    if isinstance(recipe, NVFP4Recipe):
        return (NVFP4,) * 5
    fwd, gi, gw = recipe.forward, recipe.grad_input, recipe.grad_weight
    return fwd, gi, gw, recipe.grad_elem(gi), recipe.grad_elem(gw)  # the upstream gradient's format in each


def mx_ops(g: Gemm, recipe: MXRecipe | NVFP4Recipe, path: MXPath) -> list[Op]:
    """Casts, padding, dequantize passes and GEMMs of one MX linear or grouped GEMM, forward + backward."""
    if not g.mx:
        return bf16_ops(g)
    fwd, gi, gw, g_gi, g_gw = _formats(recipe)
    ops: list[Op] = []
    # Grad weight quantizes along M: linear.py pads M to a multiple of 32 when it is not one (its
    # GEMM runs over the padded rows); with group_pad_copy grouped.py copies g and x into a zeroed
    # buffer of ceil32(M) + 32 * E rows, each group padded, else its GEMM runs over the M rows as they are.
    m_gw = g.m
    if gw != HIGH_PRECISION and ((g.groups == 1 and g.m % BLOCK) or (g.groups > 1 and path.group_pad_copy)):
        m_gw = math.ceil(g.m / BLOCK) * BLOCK + (BLOCK * g.groups if g.groups > 1 else 0)
        fill = m_gw if g.groups > 1 else 0
        if not path.fake_quant:  # the fake-quant kernels read rows past M as zeros: no padded copy
            ops.append(Op("pad g, x rows", 0.0, (fill + 2 * g.m) * (g.k + g.n) * BF16_BYTES, None))
    w_numel = g.groups * g.n * g.k
    # (tensor, numel along dim0, dim0 format, numel along dim1, dim1 format); bf16 means not needed
    needs = [
        ("x", g.m * g.k, fwd, m_gw * g.k, gw),
        ("w", w_numel, fwd, w_numel, gi),
        ("g", g.m * g.n, g_gi, m_gw * g.n, g_gw),
    ]
    for t, numel0, e0, numel1, e1 in needs:
        d0, d1 = e0 != HIGH_PRECISION, e1 != HIGH_PRECISION
        if NVFP4 in (e0, e1):  # the per-tensor maximum first: one more read (both directions' in one)
            ops.append(Op(f"amax {t}", 0.0, numel0 * BF16_BYTES, None))
        linear_once = g.groups == 1 and (path.fused_grad_cast if t == "g" else t == "x" and path.fused_x_cast)
        one_read = d0 and d1 and e0 == e1 and (path.fused_casts or linear_once)
        if path.fake_quant:  # reads the unpadded tensor (numel0); the along-M result has m_gw rows
            if one_read:
                ops.append(fake_quant_op(f"cast {t} dim0+dim1", numel0, numel0, numel1))
                continue
            if d0:
                ops.append(fake_quant_op(f"cast {t} dim0", numel0, numel0))
            if d1:
                ops.append(fake_quant_op(f"cast {t} dim1", numel0, numel1))
            continue
        if one_read and numel0 == numel1:
            ops.append(cast_op(f"cast {t} dim0+dim1", numel0, e0, fused=True))
            continue
        if d0:
            ops.append(cast_op(f"cast {t} dim0", numel0, e0))
        if d1:
            ops.append(cast_op(f"cast {t} dim1", numel1, e1))
    # operand formats of forward (x, w), grad input (g, w), grad weight (g, x)
    formats = [(fwd, fwd), (g_gi, gi), (g_gw, gw)]
    for (name, flops, a, b, out), (ea, eb) in zip(_three_gemms(g, m_gw), formats, strict=True):
        ops += _mx_gemm(name, flops, (a, ea), (b, eb), out, path)
    return ops


def step_time(ops: list[Op], dev: Device) -> float:
    return sum(op.time(dev) for op in ops)


def check_path(dev: Device, path: MXPath) -> None:
    if path.native_gemm and not dev.native_mx:
        raise ValueError(f"{dev.name} has no MX GEMM in hardware: its MX GEMMs are emulated at the bf16 rate")


@dataclass(frozen=True)
class GemmEstimate:
    gemm: Gemm
    bf16_s: float
    mx_gemm_s: float  # the MX step's GEMMs
    mx_other_s: float  # its casts, padding and dequantize passes
    mx_gemm_bound: str  # what bounds the MX step's forward GEMM

    @property
    def mx_s(self) -> float:
        return self.mx_gemm_s + self.mx_other_s

    @property
    def speedup(self) -> float:
        return self.bf16_s / self.mx_s


def estimate(g: Gemm, dev: Device, recipe: MXRecipe | NVFP4Recipe, path: MXPath) -> GemmEstimate:
    check_path(dev, path)
    ops = mx_ops(g, recipe, path)
    gemms = [op for op in ops if op.name.endswith("GEMM")]
    return GemmEstimate(
        g,
        step_time(bf16_ops(g), dev),
        step_time(gemms, dev),
        step_time([op for op in ops if not op.name.endswith("GEMM")], dev),
        gemms[0].bound(dev),
    )


def linear_speedup(m: int, k: int, n: int, dev: Device, recipe: MXRecipe, path: MXPath) -> float:
    """bf16 time / MX time of one linear's forward + backward."""
    return estimate(Gemm("linear", m, k, n), dev, recipe, path).speedup


# --- whole models ---


@dataclass(frozen=True)
class ModelGemms:
    """Every GEMM of a model's training step at a given local batch, plus what stays in bf16 outside them."""

    gemms: list[tuple[str, Gemm]]  # (layer label: "layers.N" or "" for the root, gemm named by its fqn)
    attention_flops: float  # causal SDPA, forward + backward, all layers
    attention_bytes: float
    tokens: int


def model_gemms(
    name: str, flavor: str, batch: int, seq_len: int, vocab_size: int, skip: tuple[str, ...] | list[str] | None = None
) -> ModelGemms:
    """Enumerate nn.Linear and GroupedExperts of a flavor built on the meta device (no memory, no GPU).

    Every linear sees all batch * seq_len tokens; a GroupedExperts weight runs one grouped GEMM over
    tokens * top_k rows. ``skip`` (default: convert_to_mx's) and features not multiples of 32 stay bf16.
    """
    import torch
    from torch import nn

    from mx_recipe.models import build_model, model_args
    from mx_recipe.models.moe import GroupedExperts
    from mx_recipe.nn.convert import DEFAULT_SKIP, skip_reason

    skip = DEFAULT_SKIP if skip is None else skip
    args = model_args(name, flavor, vocab_size, seq_len)
    with torch.device("meta"):
        model = build_model(args)
    tokens = batch * seq_len
    out: list[tuple[str, Gemm]] = []
    for fqn, module in model.named_modules():
        layer = ".".join(fqn.split(".")[:2]) if fqn.startswith("layers.") else ""
        if isinstance(module, nn.Linear):
            n, k = module.out_features, module.in_features
            mx = skip_reason(fqn, (n, k), skip, BLOCK) is None
            out.append((layer, Gemm(fqn, tokens, k, n, 1, mx)))
        elif isinstance(module, GroupedExperts):
            mx = skip_reason(fqn, tuple(module.w1.shape[1:]), skip, BLOCK) is None
            for w_name in ("w1", "w3", "w2"):
                e, n, k = getattr(module, w_name).shape
                out.append((layer, Gemm(f"{fqn}.{w_name}", tokens * args.top_k, k, n, e, mx)))
    # Causal attention: QK^T and PV are 4 * S * D FLOPs per token per head forward, halved by the
    # mask; backward twice forward. Bytes: q, k, v, o forward; q, k, v, o, do, dq, dk, dv backward.
    attn_flops = 3 * 2 * seq_len * args.head_dim * args.n_heads * tokens * args.n_layers
    attn_bytes = 12 * tokens * args.n_heads * args.head_dim * BF16_BYTES * args.n_layers
    return ModelGemms(out, attn_flops, attn_bytes, tokens)


@dataclass(frozen=True)
class ModelEstimate:
    device: str
    path: str
    converted_bf16_s: float  # the GEMMs convert_to_mx swaps, in the bf16 step
    converted_mx_s: float  # the same GEMMs in the MX step: GEMMs + casts (+ dequantize, padding)
    unchanged_s: float  # bf16 in both steps: skipped linears (output, router gates) and attention

    @property
    def gemm_speedup(self) -> float:
        return self.converted_bf16_s / self.converted_mx_s

    @property
    def bf16_step_s(self) -> float:
        return self.converted_bf16_s + self.unchanged_s

    @property
    def mx_step_s(self) -> float:
        return self.converted_mx_s + self.unchanged_s

    @property
    def speedup(self) -> float:
        return self.bf16_step_s / self.mx_step_s


def estimate_model(mg: ModelGemms, dev: Device, recipe: MXRecipe | NVFP4Recipe, path: MXPath) -> ModelEstimate:
    """Non-GEMM time is attention (at the bf16 peak) only, the same in both steps; norms, RoPE,
    SwiGLU, routing, loss, optimizer and communication are left out (they only lower the speedup)."""
    check_path(dev, path)
    converted = [estimate(g, dev, recipe, path) for _, g in mg.gemms if g.mx]
    kept = sum(step_time(bf16_ops(g), dev) for _, g in mg.gemms if not g.mx)
    attention = Op("attention", mg.attention_flops, mg.attention_bytes, "bf16").time(dev)
    return ModelEstimate(
        dev.name,
        path.name,
        sum(e.bf16_s for e in converted),
        sum(e.mx_s for e in converted),
        kept + attention,
    )


def layer_groups(mg: ModelGemms) -> list[tuple[list[str], list[Gemm]]]:
    """Consecutive layers with the same GEMMs (by name inside the layer and shape), merged."""
    groups: list[tuple[list[str], list[Gemm]]] = []
    for layer in dict.fromkeys(label for label, _ in mg.gemms):
        gemms = [g for label, g in mg.gemms if label == layer]
        key = [(g.name.removeprefix(layer), g.m, g.k, g.n, g.groups, g.mx) for g in gemms]
        if groups and layer and groups[-1][0][0]:
            last = groups[-1]
            last_key = [(g.name.removeprefix(last[0][0]), g.m, g.k, g.n, g.groups, g.mx) for g in last[1]]
            if key == last_key:
                last[0].append(layer)
                continue
        groups.append(([layer], gemms))
    return groups


def implied_other_time(bf16_s: float, mx_s: float, observed_speedup: float) -> float:
    """Time T the same in both steps such that (bf16 + T) / (mx + T) equals ``observed_speedup``."""
    return (bf16_s - observed_speedup * mx_s) / (observed_speedup - 1)
