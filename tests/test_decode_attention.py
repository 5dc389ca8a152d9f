"""The split-KV decode-attention kernel (kernels/decode_attention.py, through mx_recipe.infer.attention) against
softmax attention over the visible cache positions, computed in fp64 with plain torch from the same inputs.

* CPU, in this process: argument errors, the op's fake shape and the rule (``use_kernel``); the split kernel
  compiled for sm_90a: a chunk of one tile issues all of its loads before its first wait.
* CPU, Triton interpreter (``test_interp_*``), in a child pytest with TRITON_INTERPRET=1 as in
  tests/test_weight_only_gemm.py (with tests/test_gemm_triton.py's shim for the interpreter's int() of a scalar):
  B in {1, 2}, Hkv in {1, 8}, R in {1, 4}, D in {64, 128}, L in {1, 17, 300}, lengths 1, L and one inside a
  later split ([1] and per-sequence [B] lengths), fp32 and bf16, the splits of one tile, of several and one
  split; strided caches and q; positions at or past ``length`` never read (NaN there changes no bit); the op
  under opcheck and torch.compile; decode steps through the kernel give the full forward's logits; appending
  the step's own position (RoPE, the cache write, attention over it: at 0, in the first and a later split, at the
  cache's end, per-sequence lengths, fp32 and bf16 RoPE tables) against ``apply_rope``, the caches so written
  and the reference; q, k and v as a QKV GEMM's split-K sums, bit for bit the step fed their rounded sum (the
  GEMM's own partials: tests/test_weight_only_tiled.py). Run them directly with
  ``TRITON_INTERPRET=1 pytest tests/test_decode_attention.py -k interp_``.
* GPU (``gpu``): bf16 and fp32 at Llama 3 8B's head shapes against the reference and against SDPA with the mask
  decode.py builds; appending at those shapes; the ops in a captured CUDA graph replayed at new lengths; decode
  steps on CUDA (eager, compiled, CUDA graph) take the kernel and give the full forward's logits.

Bound. The kernel computes in fp32 from the inputs' values (fp32 dots, no TF32): against the fp64 reference it
is off by a few fp32 roundings of the scores, weights and sums, well inside ATOL = 1e-5 at these sizes
(outputs of order 1). Its output is then rounded to q's dtype: for bf16 by at most rho |y|, rho = 2**-8 (to
nearest), 2**-7 in the interpreter (its fp32 -> bf16 cast truncates). So |y - r| <= ATOL + rho |r|.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re

import pytest
import torch
import torch.nn.functional as F
from test_cast_kernels import run_interpreter_tests

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
HAS_TRITON = importlib.util.find_spec("triton") is not None
ATOL = 1e-5

interp_only = pytest.mark.skipif(not (INTERP and HAS_TRITON), reason="runs in the Triton interpreter child process")

if INTERP and HAS_TRITON:
    from test_gemm_triton import _install_interpreter_shims  # noqa: F401  (installed on import)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: torch.Tensor, scale: float | None = None
              ) -> torch.Tensor:  # fmt: skip
    """Softmax attention of q [B, Hkv, R, D] over k, v [B, Hkv, L, D] at positions < length ([1] or [B]), fp64."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    lengths = length.expand(q.shape[0]).tolist()
    out = []
    for b, n in enumerate(lengths):
        s = q[b].double() @ k[b, :, :n].double().transpose(-1, -2) * scale
        out.append(s.softmax(-1) @ v[b, :, :n].double())
    return torch.stack(out)


def assert_within_bound(y: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: torch.Tensor,
                        scale: float | None = None) -> None:  # fmt: skip
    r = reference(q.cpu(), k.cpu(), v.cpu(), length.cpu(), scale)
    assert y.dtype == q.dtype and y.shape == q.shape
    rho = 0.0 if q.dtype == torch.float32 else 2.0**-7 if INTERP else 2.0**-8
    excess = (y.cpu().double() - r).abs() - (ATOL + rho * r.abs())
    assert excess.max() <= 0, f"{tuple(q.shape)} {tuple(k.shape)} length {length.tolist()}: {excess.max().item():.3g}"


def operands(b: int, hkv: int, reps: int, d: int, cache_len: int, dtype: torch.dtype, device: str = "cpu",
             seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Normal q [B, Hkv, R, D], k and v [B, Hkv, L, D]."""
    g = torch.Generator(device).manual_seed(seed)
    q, k, v = (torch.randn(b, hkv, n, d, generator=g, device=device).to(dtype) for n in (reps, cache_len, cache_len))
    return q, k, v


def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: torch.Tensor, **kw) -> torch.Tensor:
    from mx_kernels.decode_attention import decode_attention

    return decode_attention(q, k, v, length, **kw)


def lengths(b: int, cache_len: int) -> list[list[int]]:
    """The lengths to test on a cache of ``cache_len`` positions: 1, all of it and, for 300, 200: inside a later
    split at every D and split count here, past a tile boundary. One sequence: each as [1]; two: [B] and [1]."""
    inner = [200] if cache_len == 300 else []
    if b == 1:
        return [[n] for n in sorted({1, cache_len, *inner})]
    return [[1, cache_len], *([inner] if inner else [])]


def append_case(b: int, hkv: int, reps: int, d: int, cache_len: int, dtype: torch.dtype, device: str = "cpu",
                tables: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """A decode step's unrotated q [B, Hkv, R, D] and k, v [B, Hkv * D] (views of one fused projection's output, as
    decode.py passes them), caches [B, Hkv, L, D] and the model's RoPE tables (in ``tables``: a bf16 model's
    buffers are bf16)."""
    from mx_recipe.models.llama import rope_tables

    g = torch.Generator(device).manual_seed(b * 100 + hkv * 10 + reps + d)
    fused = torch.randn(b, (hkv * reps + 2 * hkv) * d, generator=g, device=device).to(dtype)
    q, k, v = fused.split([hkv * reps * d, hkv * d, hkv * d], dim=-1)
    k_cache, v_cache = (torch.randn(b, hkv, cache_len, d, generator=g, device=device).to(dtype) for _ in range(2))
    cos, sin = rope_tables(d, cache_len, 500000.0, device)
    return q.view(b, hkv, reps, d), k, v, cos.to(tables), sin.to(tables), k_cache, v_cache


def round_as_kernel(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 ``x`` in ``dtype`` as the kernel rounds it: to nearest, but truncated by the interpreter's bf16 cast."""
    if INTERP and dtype == torch.bfloat16:
        return (x.view(torch.int32) & -65536).view(torch.float32).to(dtype)
    return x.to(dtype)


def split_sums_case(b: int, hkv: int, reps: int, d: int, splits: int, per_column: bool | None, device: str = "cpu"
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """A QKV GEMM's fp32 split-K sums [S, B, (Hkv * R + 2 Hkv) D] (v's column 5 -0.0 in every split: the sum starts
    from +0, and v goes to the cache as it is) and their scale (per column, one, or None)."""
    g = torch.Generator(device).manual_seed(splits * 10 + b)
    parts = torch.randn(splits, b, hkv * (reps + 2) * d, generator=g, device=device) * 4
    parts[:, :, hkv * (reps + 1) * d + 5] = -0.0
    if per_column is None:
        return parts, None
    n = parts.shape[-1] if per_column else 1
    return parts, torch.rand(n, generator=g, device=device) * 0.5 + 0.01


def summed_as_kernel(parts: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The GEMM's output from its split sums: added in split order from 0, times the scale, rounded to ``dtype``."""
    total = torch.zeros_like(parts[0])
    for part in parts:
        total += part
    return round_as_kernel(total if scale is None else total * scale.flatten(), dtype)


def append_split_sums(parts: torch.Tensor, scale: torch.Tensor | None, hkv: int, reps: int, d: int,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, length: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, **kw) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``decode_attention_append`` of a QKV GEMM's split sums, and of the output they sum to (``summed_as_kernel``),
    each on its own copy of the caches; asserts the caches come out the same and returns both outputs."""
    from mx_recipe.infer.attention import decode_attention_append

    b = parts.shape[1]
    sizes = [hkv * reps * d, hkv * d, hkv * d]
    q, k, v = parts.split(sizes, dim=-1)
    caches = k_cache.clone(), v_cache.clone()
    got = decode_attention_append(q.view(-1, b, hkv, reps, d), k, v, cos, sin, *caches, length, qkv_scale=scale,
                                  **kw)  # fmt: skip
    q, k, v = summed_as_kernel(parts, scale, k_cache.dtype).split(sizes, dim=-1)
    want = decode_attention_append(q.view(b, hkv, reps, d), k, v, cos, sin, k_cache, v_cache, length, **kw)
    assert torch.equal(caches[0].view(torch.int16), k_cache.view(torch.int16))
    assert torch.equal(caches[1].view(torch.int16), v_cache.view(torch.int16))
    return got, want


def check_append(b: int, hkv: int, reps: int, d: int, cache_len: int, dtype: torch.dtype, lengths: torch.Tensor,
                 device: str = "cpu", tables: torch.dtype = torch.float32, **kw) -> None:  # fmt: skip
    """decode_attention_append at ``lengths``: the caches gain the rotated k and v at length - 1 and nothing else;
    the output is attention over the caches so written with q rotated as ``apply_rope`` (module doc's bound; bf16
    widened by one rounding of every q element, where the kernel's fp32 rotation may round the other way)."""
    from mx_recipe.models.llama import apply_rope

    q, k, v, cos, sin, k_cache, v_cache = append_case(b, hkv, reps, d, cache_len, dtype, device, tables)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    pos = (lengths.expand(b) - 1).tolist()
    rot_q = torch.empty(q.shape, dtype=dtype, device=device)
    for i, p in enumerate(pos):
        rows = cos[p : p + 1], sin[p : p + 1]
        rot_q[i] = round_as_kernel(apply_rope(q[i : i + 1].reshape(1, 1, -1, d).float(), *rows), dtype).view(q[i].shape)
        want_k[i, :, p] = round_as_kernel(apply_rope(k[i : i + 1].view(1, 1, hkv, d).float(), *rows)[0, 0], dtype)
        want_v[i, :, p] = v[i].view(hkv, d)
    if "run" in kw:
        out = kw.pop("run")(q, k, v, cos, sin, k_cache, v_cache, lengths)
    else:
        out = run(q, k_cache, v_cache, lengths, append=(k, v, cos, sin), **kw)
    assert torch.equal(v_cache, want_v)
    torch.testing.assert_close(k_cache, want_k, rtol=0 if dtype == torch.float32 else 2**-7, atol=1e-6)
    r = reference(rot_q.cpu(), k_cache.cpu(), v_cache.cpu(), lengths.cpu())
    rho = 0.0 if dtype == torch.float32 else 2.0**-7 if INTERP else 2.0**-8
    flips = 0.0 if dtype == torch.float32 else 2.0**-8 * (rot_q.cpu().double().abs() @ k_cache.cpu().double().abs(
        ).transpose(-1, -2)).amax() / math.sqrt(d) * 2 * v_cache.cpu().double().abs().amax()  # fmt: skip
    excess = (out.cpu().double() - r).abs() - (ATOL + rho * r.abs() + flips)
    assert excess.max() <= 0, f"{tuple(q.shape)} L {cache_len} lengths {lengths.tolist()}: {excess.max().item():.3g}"


# ---------------------------------------------------------------------------------------
# CPU, in this process


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_bad_operands_are_one_line_errors_naming_the_argument():
    from mx_kernels.decode_attention import check

    q, k, v = operands(2, 2, 4, 64, 10, torch.bfloat16)
    n = torch.tensor([5])
    cases = [
        (dict(q=q[0]), "q must be a 4D"),
        (dict(q=q.to(torch.int32)), "q must be a 4D"),
        (dict(k_cache=k[0]), "k_cache must be a 4D"),
        (dict(v_cache=v.to(torch.float64)), "v_cache must be a 4D"),
        (dict(k_cache=k[:1]), r"k_cache \(1, 2, 10, 64\) does not match q"),
        (dict(v_cache=v[..., :32]), "v_cache .* does not match q"),
        (dict(k_cache=torch.randn(2, 2, 10, 128)[..., ::2]), "k_cache must have its last dim contiguous"),
        (dict(k_cache=k[:, :, :0], v_cache=v[:, :, :0]), "k_cache holds no positions"),
        (dict(v_cache=v[:, :, :7]), "k_cache .* and v_cache .* differ in shape"),
        (dict(q=q[..., :48], k_cache=k[..., :48], v_cache=v[..., :48]), "head dim D must be a power of 2"),
        (dict(q=q[..., :8], k_cache=k[..., :8], v_cache=v[..., :8]), "head dim D must be a power of 2"),
        (dict(length=n.float()), "length must be an int32 or int64 tensor"),
        (dict(length=torch.tensor(5)), "length must be an int32 or int64 tensor"),
        (dict(length=torch.tensor([5, 5, 5])), r"length must be .* \[1\] or \[B\] \(B = 2\)"),
        (dict(length=torch.tensor([5], device="meta")), "length is on meta"),
    ]
    for change, message in cases:
        args = dict(q=q, k_cache=k, v_cache=v, length=n)
        with pytest.raises(ValueError, match=message) as info:
            check(**{**args, **change})
        assert "\n" not in str(info.value)
    if not INTERP:
        with pytest.raises(ValueError, match="needs CUDA tensors"):
            run(q, k, v, n)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_bad_split_sums_are_one_line_errors():
    from mx_kernels.decode_attention import check_split_sums

    parts, scale = split_sums_case(2, 2, 4, 64, 3, True)
    q, k, v = parts.split([512, 128, 128], dim=-1)
    q = q.view(3, 2, 2, 4, 64)
    cache = torch.empty(2, 2, 10, 64, dtype=torch.bfloat16)
    cases = [
        (dict(q=q[0]), r"split sums are fp32 q \[S, B, Hkv, R, D\]"),
        (dict(k=k.bfloat16()), "split sums are fp32"),
        (dict(q=q.transpose(2, 3)), "q heads must be consecutive columns of a row"),
        (dict(k_cache=cache.float()), "rounded to the caches' dtype, a 16-bit one"),
        (dict(qkv_scale=scale[:7]), r"qkv_scale is fp32, one or one per column of \[q \| k \| v\] \(768\)"),
        (dict(qkv_scale=scale.double()), "qkv_scale is fp32"),
    ]
    for change, message in cases:
        args = dict(q=q, k=k, v=v, k_cache=cache, qkv_scale=scale)
        with pytest.raises(ValueError, match=message) as info:
            check_split_sums(**{**args, **change})
        assert "\n" not in str(info.value)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_bad_append_operands_are_one_line_errors():
    from mx_kernels.decode_attention import check_append

    q, k, v, cos, sin, k_cache, _ = append_case(2, 2, 4, 64, 10, torch.bfloat16)
    cases = [
        (dict(k=k[:, :64]), "appended k must be .* = \\[2, 128\\]"),
        (dict(v=v[:1]), "appended v must be"),
        (dict(k=k.reshape(128, 2).T), "appended k must be"),
        (dict(cos=cos[:, :16]), "RoPE table cos must be a contiguous float"),
        (dict(sin=sin.double()), "RoPE table sin must be a contiguous float"),
        (dict(sin=sin.to("meta")), "sin is on meta"),
    ]
    for change, message in cases:
        args = dict(q=q, k_cache=k_cache, k=k, v=v, cos=cos, sin=sin)
        with pytest.raises(ValueError, match=message) as info:
            check_append(**{**args, **change})
        assert "\n" not in str(info.value)


def test_fake_shape_and_the_rule(pretend_gpu):
    from torch._subclasses.fake_tensor import FakeTensorMode

    from mx_recipe.infer.attention import use_kernel

    with FakeTensorMode():
        q, k = torch.empty(2, 8, 4, 128, dtype=torch.bfloat16), torch.empty(2, 8, 1024, 128, dtype=torch.bfloat16)
        out = torch.ops.mx_recipe.decode_attention(q, k, k, torch.empty(1, dtype=torch.int64))
        assert out.shape == (2, 8, 4, 128) and out.dtype == torch.bfloat16
        new, table = torch.empty(2, 1024, dtype=torch.bfloat16), torch.empty(1024, 64)
        out = torch.ops.mx_recipe.decode_attention_append(
            q, new, new, table, table, k, k, torch.empty(1, dtype=torch.int64)
        )
        assert out.shape == (2, 8, 4, 128) and out.dtype == torch.bfloat16
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    pretend_gpu((9, 0))
    assert use_kernel(cuda, 128) and use_kernel(cuda, 64) and use_kernel(cuda, 16)
    assert not use_kernel(cpu, 128)
    assert not use_kernel(cuda, 96) and not use_kernel(cuda, 8) and not use_kernel(cuda, 512)
    pretend_gpu((7, 5))
    assert not use_kernel(cuda, 128)
    pretend_gpu(None)  # not an NVIDIA GPU
    assert not use_kernel(cuda, 128)


def test_split_count_spreads_the_cache_and_leaves_no_empty_chunk():
    pytest.importorskip("triton")
    from mx_kernels.decode_attention import BLOCK_L, PROGRAMS_PER_SM, split_count

    h200 = 132
    for bh in (1, 3, 8, 32, 64, 300):
        for cache_len in (1, 15, 16, 17, 300, 1024, 4096):
            for splits in (None, 1, 7, 1000):
                n, chunk = split_count(bh, cache_len, BLOCK_L, h200, splits)
                assert chunk % BLOCK_L == 0 and (n - 1) * chunk < cache_len <= n * chunk  # none empty at full length
                assert n <= min(splits or n, math.ceil(cache_len / BLOCK_L))
                if splits is None and n < math.ceil(cache_len / BLOCK_L):  # short of a chunk a tile: SMs filled
                    assert bh * n > (PROGRAMS_PER_SM - 1) * h200
    assert split_count(8, 1024, BLOCK_L, h200) == (32, 32)  # Llama 3 8B at batch 1: 256 programs of 2 tiles
    assert split_count(264, 1024, BLOCK_L, h200) == (1, 1024)  # one split: the output straight from the split kernel
    # the nearest count, not the next: batch 32 (256 heads) one wave of one chunk a head, batch 8 (64) four
    assert split_count(256, 1024, BLOCK_L, h200) == (1, 1024)
    assert split_count(64, 1024, BLOCK_L, h200) == (4, 256)
    assert split_count(176, 1024, BLOCK_L, h200) == (2, 512)  # 1.5: halves up


@pytest.fixture
def split_launches(monkeypatch) -> list[dict]:
    """The split kernel's launch arguments as ``decode_attention`` builds them, captured instead of launched (CPU
    tensors pass its CUDA check)."""
    from mx_kernels import decode_attention as kernel

    launches = []

    class Capture:
        def launch_keyed(self, key, build, **kwargs):
            launches.append(build()[1])

    monkeypatch.setattr(kernel, "_SPLIT", Capture())
    monkeypatch.setattr(kernel, "check", lambda *args: None)
    return launches


@pytest.mark.skipif(INTERP or not HAS_TRITON, reason="compiles with Triton's CUDA backend")
def test_one_tile_chunk_reads_the_cache_before_the_pdl_wait(split_launches):
    """What the interpreter cannot check: compiled for sm_90a with the arguments the launcher builds for a decode
    step at Llama 3 8B's heads (batch 1, 1024 positions, 16 chunks of one 64-position tile, appending), under PDL.
    The key and value tile's 16-byte loads and the RoPE rows' precede the PDL wait (none is the previous kernel's
    output: they move while it runs); after the wait, q's, the step's key's and value's loads all precede the next
    barrier: one wait for all of them (the combine's reads of the partials, after the counter, aside). The next
    kernel may launch before the first MMA."""
    from mx_kernels import decode_attention as kernel
    from mx_kernels.gluon.common import compile_for_arch

    launches = split_launches
    bf16 = torch.bfloat16
    q, cache = torch.empty(1, 8, 4, 128, dtype=bf16), torch.empty(1, 8, 1024, 128, dtype=bf16)
    new, table = torch.empty(1, 8 * 128, dtype=bf16), torch.empty(1024, 64)
    append = (new, new, table, table)
    kernel.decode_attention(q, cache, cache, torch.tensor([1024]), splits=16, block_l=64, append=append)
    (kwargs,) = launches
    assert kwargs["ONE_TILE"] and kwargs["MMA16"] and kwargs["SPLITS"] == 16
    ptx = compile_for_arch(kernel._split_kernel, dict(kwargs, PDL=True), 90).asm["ptx"]
    pdl_wait = ptx.index("griddepcontrol.wait")
    loads = [(m.group(0), m.start()) for m in re.finditer(r"ld\.global[.\w]*", ptx) if ".cg" not in m.group(0)]
    early = [op for op, at in loads if at < pdl_wait]
    late = [at for _, at in loads if at > pdl_wait]
    tile = 2 * 64 * 128 * 2 // (16 * 128)  # keys and values in 16-byte loads, 4 warps
    assert early.count("ld.global.v4.b32") >= tile and len(early) >= tile + 2, early  # the tile, cos and sin
    assert late and max(late) < ptx.index("bar.sync", pdl_wait), "q, k and v: one wait"
    # the output projection may launch once every program got past its wait, not after the tile's work
    assert pdl_wait < ptx.index("griddepcontrol.launch_dependents") < ptx.index("mma.sync")


@pytest.mark.skipif(INTERP or not HAS_TRITON, reason="imports the Triton kernel module")
def test_pdl_only_where_a_chunk_is_one_tile(split_launches, monkeypatch):
    """Where the step launches with PDL, the attention takes it with chunks of one tile (its cache tile read before
    the wait: batch 1 and 2 of Llama 3 8B's heads at 1024 positions) and not with chunks of several (batch 4 on)."""
    from mx_kernels import decode_attention as kernel

    launches = split_launches
    monkeypatch.setattr(kernel.pdl, "options", lambda device: dict(PDL=True, launch_pdl=True))
    bf16 = torch.bfloat16
    for batch in (1, 2, 4, 32):
        q, cache = torch.empty(batch, 8, 4, 128, dtype=bf16), torch.empty(batch, 8, 1024, 128, dtype=bf16)
        splits = kernel.split_count(batch * 8, 1024, 64, 132)[0]
        kernel.decode_attention(q, cache, cache, torch.tensor([1024]), splits=splits, block_l=64)
    assert [(k["ONE_TILE"], k["PDL"], k.get("launch_pdl", False)) for k in launches] == [
        (True, True, True), (True, True, True), (False, False, False), (False, False, False)
    ]  # fmt: skip


@pytest.mark.skipif(INTERP or not HAS_TRITON, reason="this is the parent of the interpreter run")
def test_kernel_in_triton_interpreter():
    """Run the test_interp_* tests in a child pytest with TRITON_INTERPRET=1 (see module doc)."""
    run_interpreter_tests(__file__)


# ---------------------------------------------------------------------------------------
# CPU, Triton interpreter (child process)


@interp_only
@pytest.mark.parametrize(
    ("dtype", "d", "reps"),
    [(torch.float32, d, reps) for d in (64, 128) for reps in (1, 4)] + [(torch.bfloat16, d, 4) for d in (64, 128)],
    ids=lambda x: {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(x, x),
)
def test_interp_matches_the_reference(dtype, d, reps):
    """Every B, Hkv and L of the grid (module doc) at their lengths, fp32; bf16 at R = 4 and L = 300 (the kernel's
    math is fp32 either way: bf16 adds only the output's rounding). The interpreter's 8 SMs make 16 programs of
    64-position tiles: chunks of one tile (Hkv 1), of three (B 1, Hkv 8) and one split (B 2, Hkv 8)."""
    for b in (1, 2):
        for hkv in (1, 8):
            for cache_len in (300,) if dtype == torch.bfloat16 else (1, 17, 300):
                q, k, v = operands(b, hkv, reps, d, cache_len, dtype, seed=b * hkv + cache_len)
                for n in lengths(b, cache_len):
                    length = torch.tensor(n, dtype=torch.int32 if cache_len == 17 else torch.int64)
                    assert_within_bound(run(q, k, v, length), q, k, v, length)


@interp_only
def test_interp_splits_strides_and_scale():
    """Split 1 to 10 ways (one chunk per tile at most), also in the GPU's 16-position tiles; caches as decode passes
    them (one layer of a larger buffer, positions past L), q as decode's permuted view; a scale other than
    1/sqrt(D); fp16."""
    q, k, v = operands(1, 2, 3, 128, 300, torch.float32, seed=1)
    length = torch.tensor([233])
    for splits in (1, 2, 3, 10):
        assert_within_bound(run(q, k, v, length, splits=splits), q, k, v, length)
    for splits in (1, 3, 19):  # the GPU's tiles: 19 of them, 16 positions each
        assert_within_bound(run(q, k, v, length, splits=splits, block_l=16), q, k, v, length)
    with pytest.raises(ValueError, match="block_l must be a power of 2, at least 16; got 24"):
        run(q, k, v, length, block_l=24)
    buf = torch.randn(3, 2, 2, 320, 64)  # [layers, B, Hkv, max_len, D]
    k, v = buf[1, :, :, :300], buf[2, :, :, :300]
    q = torch.randn(2, 1, 2, 4, 64).permute(0, 2, 3, 1, 4).reshape(2, 2, 4, 64)  # decode's [B, Hkv, R * S, D]
    length = torch.tensor([300, 77])
    assert_within_bound(run(q, k, v, length), q, k, v, length)
    assert_within_bound(run(q, k, v, length, scale=0.5), q, k, v, length, scale=0.5)
    q16, k16, v16 = q.half(), k.half(), v.half()
    y = run(q16, k16, v16, length)
    assert y.dtype == torch.float16
    torch.testing.assert_close(y.double(), reference(q16, k16, v16, length), atol=ATOL, rtol=2.0**-10)


@interp_only
def test_interp_positions_at_or_past_length_are_never_read():
    """NaN keys and values at positions >= length change no bit of the output, whichever split they fall in."""
    for d, hkv, n, block_l in [(128, 1, [200], None), (64, 8, [1], None), (128, 2, [33, 300], None),
                               (64, 1, [64], None), (64, 1, [161], 16)]:  # fmt: skip
        b = len(n)
        q, k, v = operands(b, hkv, 4, d, 300, torch.bfloat16, seed=d + hkv)
        length = torch.tensor(n)
        clean = run(q, k, v, length, block_l=block_l)
        for i, m in enumerate(n):
            k[i, :, m:], v[i, :, m:] = float("nan"), float("nan")
        dirty = run(q, k, v, length, block_l=block_l)
        assert dirty.isfinite().all() and torch.equal(dirty, clean)
        assert_within_bound(dirty, q, k.nan_to_num(), v.nan_to_num(), length)


@interp_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_interp_append_rotates_writes_and_attends(dtype):
    """The step's own position at length - 1: at 0 (an empty loop), in the first and in a later split, at the
    cache's end; one split and several; per-sequence lengths."""
    for b, hkv, reps, d, cache_len, n, splits in [
        (1, 1, 1, 16, 1, [1], None),
        (2, 2, 4, 64, 17, [17], None),
        (1, 8, 4, 128, 300, [6], None),
        (1, 2, 4, 64, 300, [201], 3),
        (2, 2, 4, 64, 300, [1], 5),
        (2, 2, 4, 64, 300, [300, 77], 4),
    ]:
        check_append(b, hkv, reps, d, cache_len, dtype, torch.tensor(n), splits=splits)
    check_append(2, 2, 4, 64, 40, dtype, torch.tensor([33]), tables=torch.bfloat16)


@interp_only
def test_interp_append_op():
    """Through ``torch.ops.mx_recipe.decode_attention_append`` (its mutation of the caches as the schema says)."""
    from mx_recipe.infer.attention import decode_attention_append

    check_append(2, 2, 4, 64, 40, torch.float32, torch.tensor([33]), run=decode_attention_append)


@interp_only
def test_interp_append_takes_split_sums():
    """q, k and v as a QKV GEMM's fp32 split sums: the same output and caches, bit for bit, as the step fed the
    output the GEMM would write from them (summed in split order from +0, times the scale, rounded to the caches'
    dtype): one split of the cache and several, the position in the first or a later one; scales per column, one
    and none; the op's fake output."""
    from mx_recipe.infer.attention import decode_attention_append
    from mx_recipe.models.llama import rope_tables

    hkv, reps, d, cache_len = 2, 4, 64, 40
    cos, sin = rope_tables(d, cache_len, 500000.0, "cpu")
    k_cache, v_cache = torch.randn(2, 2, hkv, cache_len, d).bfloat16().unbind(0)
    for splits, per_column, length in ((3, True, [33]), (2, False, [1]), (4, None, [40]), (3, True, [5, 38])):
        parts, scale = split_sums_case(len(length), hkv, reps, d, splits, per_column)
        caches = k_cache[: len(length)], v_cache[: len(length)]
        got, want = append_split_sums(parts, scale, hkv, reps, d, *caches, torch.tensor(length), cos, sin)
        assert got.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16), want.view(torch.int16))
    q, k, v = parts.split([hkv * reps * d, hkv * d, hkv * d], dim=-1)
    args = (q.view(splits, 2, hkv, reps, d), k, v, cos, sin, *caches, torch.tensor(length), None, scale)
    torch.library.opcheck(torch.ops.mx_recipe.decode_attention_append.default, args)  # the fake's dtype and shape
    with pytest.raises(ValueError, match="qkv_scale scales split sums; q is not one"):
        decode_attention_append(q[0].view(2, hkv, reps, d), k[0], v[0], cos, sin, *caches, torch.tensor(length),
                                qkv_scale=scale)  # fmt: skip


@interp_only
def test_interp_op_opcheck_and_compile():
    import mx_recipe.infer.attention  # noqa: F401  (defines the op)

    q, k, v = operands(1, 2, 2, 16, 40, torch.float32)
    length = torch.tensor([25])
    torch.library.opcheck(torch.ops.mx_recipe.decode_attention.default, (q, k, v, length))
    step = torch.compile(lambda q, k, v, n: torch.ops.mx_recipe.decode_attention(q, k, v, n + 1), backend="aot_eager",
                         fullgraph=True)  # fmt: skip
    assert_within_bound(step(q, k, v, length - 1), q, k, v, length)


@interp_only
def test_interp_decode_steps_through_the_kernel_give_the_full_forward_logits(monkeypatch):
    """decode.forward with the kernels' rule forced on (the ops' CPU keys run the kernels here): each decode step
    takes the fused step, attending over the positions written so far, and prefill then decode steps give the
    full forward's logits."""
    from mx_recipe.infer import decode

    calls = []

    def counted(*args, **kwargs):
        calls.append(args[7].item())  # the length
        return torch.ops.mx_recipe.decode_attention_append(*args, **kwargs)

    monkeypatch.setattr(decode, "use_kernel", lambda device, head_dim: True)
    monkeypatch.setattr(decode, "decode_attention_append", counted)
    model = assert_decode_steps_give_the_full_forward("llama", "debug", 2)
    assert calls == [n for n in (9, 10, 11) for _ in range(len(model.layers))]


def assert_decode_steps_give_the_full_forward(name: str, flavor: str, batch: int) -> torch.nn.Module:
    """A debug model at random (fp32, CPU): prefill 8 positions, then 3 decode steps through ``decode.forward``;
    their logits are the full forward's. Returns the model."""
    from mx_recipe.infer import decode
    from mx_recipe.models import build_model, model_args

    torch.manual_seed(0)
    model = build_model(model_args(name, flavor, 320, 64))
    model.init_weights()
    model.eval()
    tokens = torch.randint(0, 320, (batch, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(tokens)
        cache = decode.KVCache(model, batch, 16, torch.float32, torch.device("cpu"))
        steps = [decode.forward(model, tokens[:, :8], torch.arange(8), cache)]
        steps += [decode.forward(model, tokens[:, i : i + 1], torch.tensor([i]), cache) for i in range(8, 11)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)
    return model


# ---------------------------------------------------------------------------------------
# GPU

CUDA = "cuda"


def _debug_llama() -> torch.nn.Module:
    """The Llama debug model (vocab 320, 64 positions) at random on CUDA, seed 0, in eval mode."""
    from mx_recipe.models import build_model, model_args

    torch.manual_seed(0)
    model = build_model(model_args("llama", "debug", 320, 64)).to(CUDA)
    model.init_weights()
    return model.eval()


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int) -> torch.Tensor:
    """Attention as decode.py runs it on the SDPA path: the whole cache, a mask over positions >= n."""
    visible = (torch.arange(k.shape[2], device=q.device) < n)[None, :].expand(q.shape[2], -1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible)


GPU_SHAPES = [(1, 8, 4, 128, 1024), (4, 8, 4, 128, 1024), (2, 4, 8, 64, 333), (1, 1, 1, 128, 4096)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize(("b", "hkv", "reps", "d", "cache_len"), GPU_SHAPES)
def test_gpu_matches_the_reference_and_sdpa(dtype, b, hkv, reps, d, cache_len):
    """Llama 3 8B's heads (Hkv 8, R 4, D 128) at batch 1 and 4, and other shapes, at lengths 1, 2, a tile and a
    bit, mid-cache and full; bf16 also against SDPA with decode.py's mask (SDPA rounds P to bf16: looser)."""
    q, k, v = operands(b, hkv, reps, d, cache_len, dtype, CUDA)
    for n in sorted({1, 2, 37, cache_len // 2 + 3, cache_len}):
        length = torch.tensor([n], device=CUDA)
        y = run(q, k, v, length)
        assert_within_bound(y, q, k, v, length)
        if dtype == torch.bfloat16:
            torch.testing.assert_close(y, sdpa(q, k, v, n), atol=1e-2, rtol=1e-2)
    per_seq = torch.randint(1, cache_len + 1, (b,), device=CUDA, dtype=torch.int32)
    assert_within_bound(run(q, k, v, per_seq), q, k, v, per_seq)
    assert all(torch.equal(run(q, k, v, per_seq), run(q, k, v, per_seq)) for _ in range(5))  # split order: no race


@pytest.mark.gpu
def test_gpu_op_in_a_cuda_graph_replays_at_new_lengths():
    """Captured once at one length, the op replays at others from the same length tensor: right answers each."""
    from mx_recipe.infer.attention import decode_attention

    q, k, v = operands(1, 8, 4, 128, 1024, torch.bfloat16, CUDA)
    length = torch.tensor([1024], device=CUDA)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        decode_attention(q, k, v, length)  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, k, v, length)
    for n in (5, 700, 1, 1024):
        length.fill_(n)
        graph.replay()
        assert_within_bound(out, q, k, v, length)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gpu_append_rotates_writes_and_attends(dtype):
    """Llama 3 8B's heads at batch 1 and 4 over a 1024-position cache: the position first, mid-cache, last; and
    per-sequence lengths."""
    for b in (1, 4):
        for n in (1, 700, 1024):
            check_append(b, 8, 4, 128, 1024, dtype, torch.tensor([n], device=CUDA), CUDA)
    check_append(4, 8, 4, 128, 1024, dtype, torch.tensor([3, 1024, 512, 65], device=CUDA), CUDA)
    check_append(1, 8, 4, 128, 1024, dtype, torch.tensor([700], device=CUDA), CUDA, tables=torch.bfloat16)


@pytest.mark.gpu
def test_gpu_append_in_a_cuda_graph_replays_at_new_positions():
    from mx_recipe.infer.attention import decode_attention_append

    q, k, v, cos, sin, k_cache, v_cache = append_case(2, 8, 4, 128, 64, torch.bfloat16, CUDA)
    length = torch.tensor([6], device=CUDA)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        decode_attention_append(q, k, v, cos, sin, k_cache, v_cache, length)  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention_append(q, k, v, cos, sin, k_cache, v_cache, length)
    for n in (41, 64):
        length.fill_(n)
        graph.replay()
        fresh = k_cache.clone(), v_cache.clone()
        want = decode_attention_append(q, k, v, cos, sin, *fresh, length)  # the same step, eager
        assert torch.equal(out, want) and torch.equal(fresh[0], k_cache) and torch.equal(fresh[1], v_cache)


def _stepped_logits(model: torch.nn.Module, tokens: torch.Tensor, step_fn) -> torch.Tensor:
    """Logits of a prefill of tokens[:, :33], then one ``step_fn`` decode step a position to the end."""
    from mx_recipe.infer import decode

    cache = decode.KVCache(model, tokens.shape[0], 48, torch.float32, torch.device(CUDA))
    steps = [decode.forward(model, tokens[:, :33], torch.arange(33, device=CUDA), cache)]
    for i in range(33, tokens.shape[1]):
        steps.append(step_fn(model, tokens[:, i : i + 1], torch.tensor([i], device=CUDA), cache))
    return torch.cat(steps, dim=1)


@pytest.mark.gpu
def test_gpu_decode_steps_take_the_kernel(monkeypatch):
    """On CUDA every decode step's attention is the kernel; eager steps give the full forward's logits (fp32), and
    replaying the step from a CUDA graph gives the eager steps' greedy tokens."""
    from mx_recipe.infer import decode

    model = _debug_llama()
    tokens = torch.randint(0, 320, (2, 40), device=CUDA)
    kernel, calls = decode.decode_attention_append, []
    monkeypatch.setattr(decode, "decode_attention_append", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    with torch.no_grad():
        torch.testing.assert_close(_stepped_logits(model, tokens, decode.forward), model(tokens), rtol=1e-4,
                                   atol=1e-4)  # fmt: skip
    assert len(calls) == 7 * len(model.layers)
    monkeypatch.setattr(decode, "decode_attention_append", kernel)
    eager, _ = decode.generate(model, tokens[:, :9], 12)
    graphed, _ = decode.generate(model, tokens[:, :9], 12, cuda_graph=True)
    assert torch.equal(eager, graphed)


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_compiled_decode_steps_give_the_full_forward_logits():
    """torch.compile of the decode step (the attention kernel an opaque custom op in its graph) gives the full
    forward's logits (fp32). Slow: the compile takes about a minute."""
    from mx_recipe.infer import decode

    model = _debug_llama()
    tokens = torch.randint(0, 320, (2, 40), device=CUDA)
    with torch.no_grad():
        got = _stepped_logits(model, tokens, torch.compile(decode.forward))
        torch.testing.assert_close(got, model(tokens), rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_gpu_prompts_of_different_lengths_decode_as_if_alone():
    """On CUDA the kernel step takes each sequence's own position (a length per sequence): a batch of right-padded
    prompts of different lengths gives each prompt's greedy tokens alone, eager and replayed from a CUDA graph."""
    from mx_recipe.infer import decode

    model = _debug_llama()
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 320, (n,), generator=gen).to(CUDA) for n in (3, 9, 6)]
    batch = torch.stack([torch.cat([p, torch.full((9 - len(p),), 7, device=CUDA)]) for p in prompts])
    lengths = torch.tensor([len(p) for p in prompts], device=CUDA)
    alone = [decode.generate(model, p[None], 12)[0][0] for p in prompts]
    for graph in (False, True):
        batched, _ = decode.generate(model, batch, 12, cuda_graph=graph, lengths=lengths)
        for row, want in zip(batched, alone, strict=True):
            assert torch.equal(row, want), (graph, row, want)


@pytest.mark.gpu
def test_gpu_decode_graph_keeps_what_it_reads():
    """A DecodeGraph holds the model and the cache its replays read and write: with the caller's references dropped
    and their memory handed out again (filled with NaN), a replay still gives the logits it gave before."""
    import gc

    from mx_recipe.infer import decode

    model = _debug_llama()
    cache = decode.KVCache(model, 1, 16, torch.float32, torch.device(CUDA))
    with torch.no_grad():
        decode.forward(model, torch.randint(0, 320, (1, 8), device=CUDA), torch.arange(8, device=CUDA), cache)
        graph = decode.DecodeGraph(model, cache, torch.tensor([[5]], device=CUDA), torch.tensor([8], device=CUDA))
    before = graph(torch.tensor([[5]], device=CUDA), torch.tensor([8], device=CUDA)).clone()
    sizes = [t.numel() for t in (*model.parameters(), *model.buffers(), cache.k, cache.v)]
    del model, cache
    gc.collect()
    junk = [torch.full((n,), float("nan"), device=CUDA) for n in sizes for _ in range(2)]
    after = graph(torch.tensor([[5]], device=CUDA), torch.tensor([8], device=CUDA))
    assert torch.equal(after, before)
    del junk
