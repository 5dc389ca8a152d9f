"""The prefill's RoPE + KV-cache-write kernel (kernels/rope.py, ``torch.ops.mx_recipe.rope_cache_write``) against
the model's ``apply_rope`` and the cache write of mx_recipe.infer.decode.forward, bit for bit.

* CPU, in this process: argument errors are one line naming what is wrong.
* CPU, Triton interpreter (``test_interp_*``, a child pytest with TRITON_INTERPRET=1): fp32 and bf16 q, k and v as
  views of one fused QKV output, head counts not powers of 2, fp32 and bf16 tables; the caches hold the rotated k
  and v at positions 0 .. S - 1 and nothing else changed. The interpreter truncates fp32 -> bf16, so its bf16
  expectation is ``apply_rope`` in fp32 truncated (tests/test_decode_attention.py's ``round_as_kernel``).
* GPU (``gpu``): the same at Llama 3 8B's heads (32 and 8 of 128) and a 2048-token prompt, bf16, fp16 and fp32:
  every bit as ``apply_rope`` and ``.to(cache dtype)`` give it (the launch keeps each product's own rounding).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from test_cast_kernels import run_interpreter_tests
from test_decode_attention import round_as_kernel

import mx_recipe.infer.attention  # noqa: F401  (defines torch.ops.mx_recipe.rope_cache_write)
from mx_recipe.models.llama import apply_rope, rope_tables

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
HAS_TRITON = importlib.util.find_spec("triton") is not None
interp_only = pytest.mark.skipif(not (INTERP and HAS_TRITON), reason="runs in the Triton interpreter child process")


def case(b: int, s: int, h: int, hkv: int, d: int, cache_len: int, dtype: torch.dtype, device: str,
         tables: torch.dtype = torch.float32, cache_dtype: torch.dtype | None = None
         ) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """Unrotated q [B, S, H, D] and k, v [B, S, Hkv, D] as views of one fused projection's output, the model's
    RoPE tables (in ``tables``) and caches [B, Hkv, L, D] of random contents."""
    g = torch.Generator(device).manual_seed(b * 1000 + s * 10 + h)
    fused = (torch.randn(b, s, (h + 2 * hkv) * d, generator=g, device=device) * 4).to(dtype)
    q, k, v = fused.split([h * d, hkv * d, hkv * d], dim=-1)
    cos, sin = rope_tables(d, cache_len, 500000.0, device)
    caches = (torch.randn(b, hkv, cache_len, d, generator=g, device=device).to(cache_dtype or dtype) for _ in "kv")
    return q.view(b, s, h, d), k.view(b, s, hkv, d), v.view(b, s, hkv, d), cos.to(tables), sin.to(tables), *caches


def check(b: int, s: int, h: int, hkv: int, d: int, cache_len: int, dtype: torch.dtype, device: str,
          tables: torch.dtype = torch.float32, cache_dtype: torch.dtype | None = None) -> None:  # fmt: skip
    q, k, v, cos, sin, k_cache, v_cache = case(b, s, h, hkv, d, cache_len, dtype, device, tables, cache_dtype)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    rot_k = round_as_kernel(apply_rope(k.float(), cos, sin), dtype)
    want_k[:, :, :s] = round_as_kernel(rot_k.float(), want_k.dtype).transpose(1, 2)
    want_v[:, :, :s] = round_as_kernel(v.float(), want_v.dtype).transpose(1, 2)
    got = torch.ops.mx_recipe.rope_cache_write(q, k, v, cos, sin, k_cache, v_cache)
    assert got.is_contiguous() and got.dtype == dtype
    assert torch.equal(got, round_as_kernel(apply_rope(q.float(), cos, sin), dtype))
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_bad_operands_are_one_line_errors_naming_the_argument():
    q, k, v, cos, sin, k_cache, v_cache = case(1, 4, 4, 2, 16, 8, torch.float32, "cpu")
    cases = [
        (dict(q=q.double()), "of one dtype"),
        (dict(k=k[:, :, :1]), "of one dtype"),
        (dict(cos=cos[:3]), "cos must be"),
        (dict(sin=sin[:, :4]), "sin must be"),
        (dict(k_cache=k_cache[:, :1]), "k_cache must be"),
        (dict(v_cache=v_cache[:, :, :3]), "v_cache must be"),
        (dict(q=q.transpose(2, 3).contiguous().transpose(2, 3)), "last dim contiguous"),
    ]
    args = dict(q=q, k=k, v=v, cos=cos, sin=sin, k_cache=k_cache, v_cache=v_cache)
    for change, message in cases:
        with pytest.raises(ValueError, match=message) as info:
            torch.ops.mx_recipe.rope_cache_write(**{**args, **change})
        assert "\n" not in str(info.value)


def test_fake_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v, cos, sin, k_cache, v_cache = case(2, 5, 6, 2, 32, 8, torch.bfloat16, "cpu")
        assert torch.ops.mx_recipe.rope_cache_write(q, k, v, cos, sin, k_cache, v_cache).shape == (2, 5, 6, 32)


@pytest.mark.skipif(INTERP or not HAS_TRITON, reason="this is the parent of the interpreter run")
def test_kernel_in_triton_interpreter():
    run_interpreter_tests(__file__)


@interp_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tables", [torch.float32, torch.bfloat16])
def test_interp_rotates_and_writes_the_cache(dtype, tables):
    check(2, 5, 6, 2, 32, 9, dtype, "cpu", tables)  # 6 and 2 heads: padded to 8 and 2
    check(1, 3, 3, 3, 16, 3, dtype, "cpu", tables)  # the cache's every position
    check(1, 4, 4, 1, 16, 6, dtype, "cpu", tables, cache_dtype=torch.float32)  # widened into an fp32 cache


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_rotates_and_writes_the_cache_bit_for_bit(dtype):
    check(1, 2048, 32, 8, 128, 2112, dtype, "cuda")  # Llama 3 8B's heads, a 2048-token prompt
    check(2, 33, 16, 16, 128, 40, dtype, "cuda", torch.bfloat16)  # MoE 16B's heads, a bf16 model's tables
    check(3, 7, 6, 2, 64, 7, dtype, "cuda")
