"""An MoE block's decode-step routing kernels (kernels/moe_routing.py, through mx_recipe.infer.routing) against
the ``MoE`` module's own routing: ``TokenChoiceRouter`` for the choice and the scores, the stable argsort of the
choices by expert for the rows, an fp64 weighted sum for the combine and ``add_rms_norm`` for the norm after it.

* CPU, in this process: argument errors, the ops' fake shapes, and the combine's loads around the PDL wait
  (compiled for sm_90a).
* CPU, Triton interpreter (``test_interp_*``), in a child pytest with TRITON_INTERPRET=1: softmax and sigmoid
  scores, with and without the balancing bias and the renormalization, over token counts and expert counts
  that pad; the router's GEMM in the routing launch (``moe_gate_route``) against ``moe_route`` of its logits; the
  combine and norm with and without shared experts; and decode steps of an MoE model through every fused kernel against
  its full forward.
* GPU (``gpu``): the MoE 16B dims' routing (64 experts, top 6) at batch 1 to 128 (the router's GEMM in it at 1 to
  16 tokens), and the decode steps of an MoE model, eager and replayed from a CUDA graph.

Bounds. The choice and the rows are exact (the logits are continuous random values: no ties; ``moe_gate_route``'s
inputs are integers and quarters, whose sums are exact in any order). The weights are
the module's scores within fp32 roundings (the kernel's exp and sum may round differently): 1e-6 relative.
The combine sums in fp32 and rounds once, where the module rounds each product and each add to the dtype; the add
and the norm after it are ``add_rms_norm``'s, bit for bit.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from test_cast_kernels import run_interpreter_tests

from mx_recipe.infer.fused import add_rms_norm
from mx_recipe.infer.routing import moe_combine_add_rms_norm, moe_gate_route, moe_route
from mx_recipe.models.moe import MoEArgs, TokenChoiceRouter

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
HAS_TRITON = importlib.util.find_spec("triton") is not None
interp_only = pytest.mark.skipif(not (INTERP and HAS_TRITON), reason="runs in the Triton interpreter child process")

if INTERP and HAS_TRITON:
    from test_gemm_triton import _install_interpreter_shims  # noqa: F401  (installed on import)


def module_route(logits: torch.Tensor, bias: torch.Tensor | None, k: int, softmax: bool, norm: bool):
    """The module's routing of ``logits`` [T, E]: a TokenChoiceRouter whose gate is the identity, then MoE.forward's
    sort. Returns (offs, rows, each row's weight)."""
    t, e = logits.shape
    args = MoEArgs(dim=e, n_layers=1, n_heads=1, n_kv_heads=1, multiple_of=1, n_routed_experts=e, top_k=k,
                   score_func="softmax" if softmax else "sigmoid", route_norm=norm)  # fmt: skip
    router = TokenChoiceRouter(args).to(logits.device)
    with torch.no_grad():
        router.gate.weight.copy_(torch.eye(e))
        scores, idx = router(logits.float(), bias)
    flat = idx.flatten()
    offs = torch.bincount(flat, minlength=e).cumsum(0).to(torch.int32)
    order = flat.argsort(stable=True)
    return offs, (order // k).to(torch.int32), scores.flatten()[order]


def check_route(t: int, e: int, k: int, softmax: bool, with_bias: bool, norm: bool, device: str, shared: int = 0
                ) -> None:  # fmt: skip
    """The kernel's routing against the module's; ``shared`` groups after the routed ones hold every token in
    order, weight 1."""
    torch.manual_seed(t * 1000 + e * 10 + k)
    logits = torch.randn(t, e, device=device) * 2
    bias = torch.randn(e, device=device) * 0.1 if with_bias else None
    offs, rows, slots, weights = moe_route(logits, bias, k, softmax, norm, shared)
    tokens = torch.arange(t, device=device, dtype=torch.int32)
    assert torch.equal(offs[e:], t * k + t * torch.arange(1, shared + 1, device=device, dtype=torch.int32))
    assert torch.equal(rows[t * k :], tokens.repeat(shared))
    assert torch.equal(slots[:, k:], t * k + t * torch.arange(shared, device=device)[None, :] + tokens[:, None])
    assert (weights[:, k:] == 1).all()
    offs, rows, slots, weights = offs[:e], rows[: t * k], slots[:, :k], weights[:, :k].contiguous()
    want_offs, want_rows, want_weights = module_route(logits, bias, k, softmax, norm)
    assert torch.equal(offs, want_offs)
    assert torch.equal(rows, want_rows)
    # each token's k rows, in expert order (rows are sorted by expert), each holding that token
    assert torch.equal(slots, slots.sort(dim=1).values)
    assert torch.equal(rows[slots.long()], torch.arange(t, device=device, dtype=torch.int32)[:, None].expand(t, k))
    by_row = torch.empty_like(want_weights)
    by_row[slots.flatten().long()] = weights.flatten()
    torch.testing.assert_close(by_row, want_weights, rtol=1e-6, atol=1e-7)


def check_gate_route(t: int, e: int, d: int, k: int, dtype: torch.dtype, device: str, shared: int = 0) -> None:
    """``moe_gate_route`` (the router GEMM in the routing launch) gives ``moe_route``'s outputs on the router
    linear's logits: x and the gate hold small integers and quarters, so every order sums them exactly in fp32 and
    both round the same sums to the dtype. The layout (offs, rows, slots) is bit for bit; the weights within fp32
    roundings: each launch picks its own warps, and a softmax sum over another number of warps reduces in another
    order."""
    torch.manual_seed(t * 100 + e + d)
    x = torch.randint(-3, 4, (t, d), device=device).to(dtype)
    gate = (torch.randint(-3, 4, (e, d), device=device) / 4).to(dtype)
    bias = torch.randn(e, device=device) * 0.1
    logits = (x.double() @ gate.double().T).to(dtype)
    for softmax, with_bias, norm in [(True, False, False), (False, True, True)]:
        b = bias if with_bias else None
        got = moe_gate_route(x, gate, b, k, softmax, norm, shared)
        want = moe_route(logits, b, k, softmax, norm, shared)
        assert all(torch.equal(g, w) for g, w in zip(got[:3], want[:3], strict=True)), (t, e, d, softmax)
        torch.testing.assert_close(got[3], want[3], rtol=1e-6, atol=1e-7)


def check_combine_norm(t: int, k: int, d: int, dtype: torch.dtype, with_shared: bool, device: str) -> None:
    """On a zero residual stream the sum is the block's output alone (adding it to zeros is exact): within one
    rounding of the fp64 combine. On another stream, the stream plus that output and the norm are ``add_rms_norm``'s
    bit for bit, with the slots read before the PDL wait or after it."""
    torch.manual_seed(t + k + d)
    slots = torch.randperm(t * k, device=device).to(torch.int32).view(t, k)  # each row of y is one token's
    weights = torch.rand(t, k, device=device)
    y = torch.randn(t * k, d, device=device).to(dtype)
    shared = torch.randn(t, d, device=device).to(dtype) if with_shared else None
    norm_weight = (torch.rand(d, device=device) + 0.5).to(dtype)
    zeros = torch.zeros(t, d, device=device, dtype=dtype)
    block_out, _ = moe_combine_add_rms_norm(zeros, y, slots, weights, shared, norm_weight, 1e-5)
    terms = weights.double()[:, :, None] * y.double()[slots.long()]
    want = terms.sum(1) + (shared.double() if with_shared else 0)
    magnitude = terms.abs().sum(1) + (shared.double().abs() if with_shared else 0)
    one_rounding = 2.0**-7 if INTERP and dtype == torch.bfloat16 else 2.0**-8 if dtype == torch.bfloat16 else 2.0**-24
    assert block_out.dtype == dtype and block_out.shape == (t, d)
    assert ((block_out.double() - want).abs() <= one_rounding * want.abs() + 1e-6 * magnitude).all()
    h = torch.randn(t, d, device=device).to(dtype)
    want_h, want_x = add_rms_norm(h, block_out, norm_weight, 1e-5)
    for routed_early in (False, True):
        got_h, got_x = moe_combine_add_rms_norm(h, y, slots, weights, shared, norm_weight, 1e-5, routed_early)
        assert torch.equal(got_h, want_h) and torch.equal(got_x, want_x)


# ---------------------------------------------------------------------------------------
# CPU, in this process


def test_bad_arguments_are_one_line_errors():
    from mx_kernels.moe_routing import moe_combine_add_rms_norm as combine_kernel
    from mx_kernels.moe_routing import moe_gate_route as gate_route_kernel
    from mx_kernels.moe_routing import moe_route as route_kernel

    with pytest.raises(ValueError, match="logits must be \\[T, E\\]"):
        route_kernel(torch.randn(8), None, 2, True, False)
    with pytest.raises(ValueError, match="top_k must be in 1..8"):
        route_kernel(torch.randn(2, 8), None, 9, True, False)
    with pytest.raises(ValueError, match="bias must be fp32 \\[8\\]"):
        route_kernel(torch.randn(2, 8), torch.zeros(4), 2, True, False)
    with pytest.raises(ValueError, match="exceed one program"):
        route_kernel(torch.randn(1024, 64), None, 2, True, False)
    with pytest.raises(ValueError, match="x \\[T, D\\] and gate \\[E, D\\] of one float dtype"):
        gate_route_kernel(torch.randn(2, 16), torch.randn(8, 32), None, 2, True, False)
    with pytest.raises(ValueError, match="at most 16 tokens"):
        gate_route_kernel(torch.randn(17, 16), torch.randn(8, 16), None, 2, True, False)
    slots, weights = torch.zeros(2, 2, dtype=torch.int32), torch.ones(2, 2)
    h, norm_weight = torch.zeros(2, 8), torch.ones(8)
    with pytest.raises(ValueError, match="slots int32 and weights fp32"):
        combine_kernel(h, torch.randn(4, 8), slots.long(), weights, None, norm_weight, 1e-5)
    with pytest.raises(ValueError, match="y must be \\[T \\* k, D\\] = \\[4, D\\]"):
        combine_kernel(h, torch.randn(3, 8), slots, weights, None, norm_weight, 1e-5)
    with pytest.raises(ValueError, match="shared must be \\[T, D\\] = \\[2, 8\\]"):
        combine_kernel(h, torch.randn(4, 8), slots, weights, torch.randn(2, 4), norm_weight, 1e-5)
    with pytest.raises(ValueError, match="h \\[T, D\\] = \\[2, 8\\] with contiguous rows and norm_weight \\[8\\]"):
        combine_kernel(torch.zeros(3, 8), torch.randn(4, 8), slots, weights, None, norm_weight, 1e-5)


def test_fake_shapes_under_compile_tracing():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        offs, rows, slots, weights = torch.ops.mx_recipe.moe_route(torch.empty(3, 64), None, 6, True, False)
        assert (offs.shape, rows.shape, slots.shape, weights.shape) == ((64,), (18,), (3, 6), (3, 6))
        assert offs.dtype == rows.dtype == slots.dtype == torch.int32 and weights.dtype == torch.float32
        y = torch.empty(18, 32, dtype=torch.bfloat16)
        h = torch.empty(3, 32, dtype=torch.bfloat16)
        h_out, x = torch.ops.mx_recipe.moe_combine_add_rms_norm(h, y, slots, weights, None, h[0], 1e-5, True)
        assert h_out.shape == x.shape == (3, 32) and x.dtype == torch.bfloat16
        routed = torch.ops.mx_recipe.moe_gate_route(y[:3], torch.empty(64, 32, dtype=torch.bfloat16), None, 6, True,
                                                    False, 2)  # fmt: skip
        assert [r.shape for r in routed] == [(66,), (24,), (3, 8), (3, 8)]


@pytest.mark.skipif(INTERP or not HAS_TRITON, reason="compiles for sm_90a")
@pytest.mark.parametrize("routed_early", [False, True])
def test_combine_reads_the_slots_before_the_pdl_wait_if_routed_early(routed_early):
    """Compiled for sm_90a under PDL (MoE 16B dims: 8 slots, 2048 wide), the combine reads the norm's weight before
    it waits for the kernel before, with ``routed_early`` the slots and weights too (from L2), and the experts' rows
    and the stream after it, right after releasing the next kernel: every row's lines requested (prefetch) before
    the first row's load."""
    from mx_kernels.gluon.common import compile_for_arch
    from mx_kernels.moe_routing import _combine_norm_kernel

    t, k, d = 1, 8, 2048
    bf16 = dict(dtype=torch.bfloat16, device="meta")
    kwargs = dict(h_ptr=torch.empty(t, d, **bf16), y_ptr=torch.empty(t * k, d, **bf16),
                  slots_ptr=torch.empty(t, k, dtype=torch.int32, device="meta"),
                  weights_ptr=torch.empty(t, k, device="meta"), shared_ptr=torch.empty(t * k, d, **bf16),
                  w_ptr=torch.empty(d, **bf16), h_out_ptr=torch.empty(t, d, **bf16), out_ptr=torch.empty(t, d, **bf16),
                  D=d, eps=1e-5, stride_h=d, stride_y=d, stride_s=0, stride_ho=d, stride_o=d, K=k, HAS_SHARED=False,
                  ROUTED_EARLY=routed_early, PREFETCH=True, BLOCK=d, PDL=True, num_warps=8)  # fmt: skip
    ptx = compile_for_arch(_combine_norm_kernel, kwargs, 90).asm["ptx"]
    wait = ptx.index("griddepcontrol.wait")
    before, after = ptx[:wait], ptx[wait:]
    assert before.count("ld.global.cg") == (2 * k if routed_early else 0)
    assert after.count("ld.global.cg") == (0 if routed_early else 2 * k)
    assert before.count("ld.global") - before.count("ld.global.cg") == 1  # the norm's weight
    assert after.count("ld.global.v4") >= k + 1  # the experts' rows and the stream
    assert after.index("griddepcontrol.launch_dependents") < after.index("ld.global")
    first_row = after.index("ld.global.v4")
    assert after[:first_row].count("prefetch.global.L1") == k and "prefetch" not in after[first_row:]


@pytest.mark.skipif(INTERP or not HAS_TRITON, reason="this is the parent of the interpreter run")
def test_kernels_in_triton_interpreter():
    run_interpreter_tests(__file__)


# ---------------------------------------------------------------------------------------
# CPU, Triton interpreter (child process)


@interp_only
@pytest.mark.parametrize("softmax", [True, False], ids=["softmax", "sigmoid"])
def test_interp_route_is_the_modules(softmax):
    for t, e, k in [(1, 8, 2), (3, 8, 1), (5, 64, 6), (17, 12, 3), (1, 4, 4)]:
        for with_bias, norm in [(False, False), (True, False), (False, True), (True, True)]:
            check_route(t, e, k, softmax, with_bias, norm, "cpu")
        check_route(t, e, k, softmax, True, False, "cpu", shared=2)


@interp_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interp_gate_route_is_route_of_the_gates_logits(dtype):
    for t, e, d, k in [(1, 8, 64, 2), (3, 64, 200, 6), (16, 12, 96, 3)]:
        check_gate_route(t, e, d, k, dtype, "cpu")
    check_gate_route(2, 8, 64, 2, dtype, "cpu", shared=2)


@interp_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interp_combine_norm(dtype):
    for t, k, d in [(1, 1, 16), (1, 6, 100), (5, 2, 64), (3, 3, 2500)]:
        check_combine_norm(t, k, d, dtype, True, "cpu")
        check_combine_norm(t, k, d, dtype, False, "cpu")


@interp_only
def test_interp_moe_decode_steps_through_the_kernels_give_the_full_forward_logits(monkeypatch):
    """decode.forward with the kernels' rule forced on (the ops' CPU keys run the kernels here): an MoE model's
    decode steps take the fused routing and combine, and prefill then decode steps give the full forward's
    logits (fp32)."""
    from test_decode_attention import assert_decode_steps_give_the_full_forward

    from mx_recipe.infer import decode

    calls = []
    monkeypatch.setattr(decode, "use_kernel", lambda device, head_dim: True)
    monkeypatch.setattr(decode, "moe_route", lambda *args: calls.append(1) or moe_route(*args))
    monkeypatch.setattr(decode, "moe_gate_route", lambda *args: calls.append(1) or moe_gate_route(*args))
    model = assert_decode_steps_give_the_full_forward("moe", "debug_moe", 3)
    moe_layers = sum(getattr(layer, "moe_enabled", False) for layer in model.layers.values())
    assert moe_layers and len(calls) == 3 * moe_layers


@interp_only
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_interp_folded_shared_experts_decode_steps(monkeypatch, fmt):
    """Two shared experts folded into MXFP4 or NVFP4 experts (``fuse_projections``; NVFP4 with a tensor scale per
    group and row): decode steps through the routing kernels route them as groups of every token (``shared`` = 2),
    and give the unfolded model's logits (fp32, the reference GEMMs on the CPU)."""
    import copy
    import dataclasses

    from mx_recipe.infer import decode
    from mx_recipe.infer.weights import fuse_projections, quantize_model
    from mx_recipe.models import build_model, model_args

    torch.manual_seed(0)
    model = build_model(dataclasses.replace(model_args("moe", "debug_moe", 320, 64), n_shared_experts=2))
    model.init_weights()
    unfolded = quantize_model(model.eval(), fmt)
    folded = fuse_projections(copy.deepcopy(unfolded))
    assert all(m.experts.shared == 2 for m in folded.modules() if hasattr(m, "shared_experts"))
    shared = []
    monkeypatch.setattr(decode, "use_kernel", lambda device, head_dim: True)
    monkeypatch.setattr(decode, "moe_route", lambda *args: shared.append(args[-1]) or moe_route(*args))
    monkeypatch.setattr(decode, "moe_gate_route", lambda *args: shared.append(args[-1]) or moe_gate_route(*args))
    tokens = torch.randint(0, 320, (2, 11), generator=torch.Generator().manual_seed(1))
    logits = []
    with torch.no_grad():
        for m in (unfolded, folded):
            cache = decode.KVCache(m, 2, 16, torch.float32, torch.device("cpu"))
            steps = [decode.forward(m, tokens[:, :8], torch.arange(8), cache)]
            steps += [decode.forward(m, tokens[:, i : i + 1], torch.tensor([i]), cache) for i in range(8, 11)]
            logits.append(torch.cat(steps, dim=1))
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)
    assert set(shared) == {0, 2}


# ---------------------------------------------------------------------------------------
# GPU


@pytest.mark.gpu
def test_gpu_route_moe16b_dims():
    for t in (1, 8, 32, 128):
        check_route(t, 64, 6, True, False, False, "cuda", shared=2)
        check_route(t, 64, 6, False, True, True, "cuda")
    for t, d in [(1, 2048), (32, 2048)]:
        check_combine_norm(t, 8, d, torch.bfloat16, True, "cuda")
        check_combine_norm(t, 8, d, torch.bfloat16, False, "cuda")
    for t in (1, 8, 16):
        check_gate_route(t, 64, 2048, 6, torch.bfloat16, "cuda", shared=2)


@pytest.mark.gpu
def test_gpu_moe_decode_steps_give_the_full_forward_logits(monkeypatch):
    """On CUDA an MoE model's decode steps (bf16: torch._grouped_mm's dtype) take the fused routing: eager steps
    give the full forward's logits within bf16 roundings, and the steps replayed from a CUDA graph the eager
    steps' greedy tokens."""
    from mx_recipe.infer import decode
    from mx_recipe.infer.load import to_compute_dtype
    from mx_recipe.models import build_model, model_args

    torch.manual_seed(0)
    model = build_model(model_args("moe", "debug_moe", 320, 64)).to("cuda")
    model.init_weights()
    model = to_compute_dtype(model.eval(), torch.bfloat16)
    tokens = torch.randint(0, 320, (4, 40), device="cuda")
    calls = []
    monkeypatch.setattr(decode, "moe_route", lambda *args: calls.append(1) or moe_route(*args))
    monkeypatch.setattr(decode, "moe_gate_route", lambda *args: calls.append(1) or moe_gate_route(*args))
    with torch.no_grad():
        full = model(tokens)
        cache = decode.KVCache(model, 4, 48, torch.bfloat16, torch.device("cuda"))
        steps = [decode.forward(model, tokens[:, :33], torch.arange(33, device="cuda"), cache)]
        for i in range(33, 40):
            steps.append(decode.forward(model, tokens[:, i : i + 1], torch.tensor([i], device="cuda"), cache))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=3e-2, atol=3e-2)
    assert len(calls) == 7 * sum(getattr(layer, "moe_enabled", False) for layer in model.layers.values())
    eager, _ = decode.generate(model, tokens[:, :9], 12)
    graphed, _ = decode.generate(model, tokens[:, :9], 12, cuda_graph=True)
    assert torch.equal(eager, graphed)
