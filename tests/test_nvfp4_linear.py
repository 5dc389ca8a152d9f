"""The NVFP4 linear (mx_recipe/ops/nvfp4_backends.py) and recipe: its three GEMMs rebuilt from the public reference
pieces bit for bit, each recipe option doing what it says, conversion and train.py with an NVFP4 recipe."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mx_recipe import MXLinear, convert_to_mx, mx_linear
from mx_recipe.formats.nvfp4 import hadamard_transform, random_signs, to_nvfp4
from mx_recipe.formats.recipe import NVFP4_RECIPES, NVFP4Recipe
from mx_recipe.models import build_model, model_args
from mx_recipe.train.config import ConfigError, MXConfig, build_mx_recipe, load_config, parse_overrides


def _values(t: torch.Tensor, dim: int, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    q = to_nvfp4(t, dim, **kwargs)
    return q.block_values().to(t.dtype), q.per_tensor_scale


def _gemm(a: torch.Tensor, b: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    return (a @ b.t()).float().mul(alpha).to(a.dtype)


def _expected(x, w, g, recipe: NVFP4Recipe, seed: int):
    """y, gx, gw from to_nvfp4 and hadamard_transform, drawing the stochastic rounding's bits in the NVFP4 backend.s
    order (g along N, then g along M)."""
    tiles = {"block_shape": (16, 16) if recipe.weight_tiles else (1, 16)}
    x_k, s_x = _values(x, -1)
    w_k, s_w = _values(w, -1, **tiles)
    y = _gemm(x_k, w_k, s_x * s_w)
    torch.manual_seed(seed)
    g_n, s_g = _values(g, -1, rounding=recipe.grad_rounding)
    w_n, s_wn = _values(w, 0, **tiles)
    gx = _gemm(g_n, w_n.t(), s_g * s_wn)
    pad = -x.shape[0] % 16
    g_p, x_p = F.pad(g, (0, 0, 0, pad)), F.pad(x, (0, 0, 0, pad))
    if recipe.hadamard:
        signs = random_signs(recipe.hadamard_seed)
        g_p, x_p = hadamard_transform(g_p, signs, dim=0), hadamard_transform(x_p, signs, dim=0)
    g_m, s_gm = _values(g_p, 0, rounding=recipe.grad_rounding)
    x_m, s_xm = _values(x_p, 0)
    gw = _gemm(g_m.t().to(x.dtype), x_m.t().to(x.dtype), s_gm * s_xm)
    return y, gx, gw


@pytest.mark.parametrize("name", sorted(NVFP4_RECIPES))
@pytest.mark.parametrize("rows", [64, 40])  # 40: token rows padded to 48 for the along-M casts
def test_nvfp4_linear_is_its_reference_pieces_bit_for_bit(name, rows):
    recipe = NVFP4Recipe.from_name(name, hadamard_seed=3)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 64, generator=generator).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(48, 64, generator=generator) * 0.1).to(torch.bfloat16).requires_grad_()
    g = torch.randn(rows, 48, generator=generator).to(torch.bfloat16)
    y = mx_linear(x, w, None, recipe)
    torch.manual_seed(7)
    y.backward(g)
    expected = _expected(x.detach(), w.detach(), g, recipe, seed=7)
    for got, want, what in zip((y, x.grad, w.grad), expected, ("y", "gx", "gw"), strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want), what
    # close to bf16 (4-bit elements: a few percent)
    exact = x.detach().float() @ w.detach().float().t()
    assert F.cosine_similarity(y.float().flatten(), exact.flatten(), dim=0) > 0.98


def test_each_option_changes_what_it_says():
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(64, 64, generator=generator).to(torch.bfloat16)
    w = torch.randn(32, 64, generator=generator).to(torch.bfloat16)
    g = torch.randn(64, 32, generator=generator).to(torch.bfloat16)

    def run(recipe: NVFP4Recipe, seed: int = 0):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = mx_linear(xr, wr, None, recipe)
        torch.manual_seed(seed)
        y.backward(g)
        return y, xr.grad, wr.grad

    base = run(NVFP4Recipe())
    assert all(torch.equal(a, b) for a, b in zip(base, run(NVFP4Recipe()), strict=True))  # same seed, same bits
    no_rht = run(NVFP4Recipe(hadamard=False))  # only the grad-weight GEMM changes
    assert torch.equal(no_rht[0], base[0]) and torch.equal(no_rht[1], base[1]) and not torch.equal(no_rht[2], base[2])
    other_signs = run(NVFP4Recipe(hadamard_seed=1))
    assert torch.equal(other_signs[1], base[1]) and not torch.equal(other_signs[2], base[2])
    rows = run(NVFP4Recipe(weight_tiles=False))  # the weight's quantization: forward and grad input
    assert not torch.equal(rows[0], base[0]) and not torch.equal(rows[1], base[1])
    nearest = NVFP4Recipe(grad_rounding="nearest")  # no random bits: any seed gives the same gradients
    assert all(torch.equal(a, b) for a, b in zip(run(nearest, 0), run(nearest, 1), strict=True))
    assert not torch.equal(run(NVFP4Recipe(), 1)[1], base[1])  # stochastic: another draw, other bits

    with pytest.raises(ValueError, match="divisible by 16"):
        mx_linear(x[:, :40], w[:, :40], None, NVFP4Recipe())
    with pytest.raises(ValueError, match="unknown NVFP4 recipe"):
        NVFP4Recipe.from_name("nvfp8")
    with pytest.raises(ValueError, match="expected one of"):
        NVFP4Recipe(backend="triton")


def test_conversion_and_the_recipe_from_the_config(tmp_path):
    torch.manual_seed(0)
    model = build_model(model_args("moe", "debug_moe", 256, 64))
    model.init_weights()
    records = convert_to_mx(model, NVFP4Recipe(), skip=["output", "*router.gate", "layers.3.*"], log=False)
    experts = [r for r in records if r.fqn.endswith("moe.experts")]
    assert [r.converted for r in experts] == [True, True, False]  # the last block kept in bf16, as the recipe does
    assert isinstance(model.layers["0"].attention.wq, MXLinear)

    mx = MXConfig(recipe="nvfp4_no_rht", grad_rounding="nearest")
    assert build_mx_recipe(mx, seed=5) == NVFP4Recipe(
        "nvfp4_no_rht", hadamard=False, grad_rounding="nearest", hadamard_seed=5
    )
    with pytest.raises(ConfigError, match="--mx.backend: .*NVFP4Recipe.backend='triton'"):
        load_config("debug_mxfp8", parse_overrides(["--mx.recipe", "nvfp4", "--mx.backend", "triton"]))
    with pytest.raises(ConfigError, match="--mx.save_mx_input: is an MX cast option"):
        load_config("debug_mxfp8", parse_overrides(["--mx.recipe", "nvfp4", "--mx.save_mx_input", "true"]))
    with pytest.raises(ConfigError, match="--mx.recipe: .*nvfp4_no_rht"):  # the known names include NVFP4's
        load_config("debug_mxfp8", parse_overrides(["--mx.recipe", "nvfp5"]))


def test_train_py_runs_an_nvfp4_recipe_and_resumes_with_its_signs(tmp_path):
    """Three steps of the debug Llama in nvfp4 with a checkpoint at step 2; a rerun resumes from it to the same
    step-3 loss: the Hadamard signs come from job.seed in the checkpoint's config."""
    from test_train import BF16_ARGS, run_in_process

    args = [*BF16_ARGS, "--mx.recipe", "nvfp4", "--training.steps", "3", "--checkpoint.enable", "true"]
    args += ["--checkpoint.interval", "2"]
    code, out, err = run_in_process([*args, "--job.output_dir", str(tmp_path / "a")])
    assert code == 0, err
    assert "mx recipe nvfp4" in out
    first = [line for line in out.splitlines() if line.startswith("step      3/3")]
    (tmp_path / "a" / "checkpoints" / "step-3").rename(tmp_path / "a" / "step-3-aside")
    (tmp_path / "a" / "DONE").unlink()
    code, out, err = run_in_process([*args, "--job.output_dir", str(tmp_path / "a")])
    assert code == 0, err
    assert "resuming from checkpoint" in out
    again = [line for line in out.splitlines() if line.startswith("step      3/3")]
    loss = [lines[0].split("loss")[1].split()[0] for lines in (first, again)]
    assert loss[0] == loss[1]  # the same bits: the signs and the random bits of stochastic rounding resume


@pytest.mark.parametrize("name", ["nvfp4", "nvfp4_1d_weights"])
def test_nvfp4_linear_compiles_as_one_graph(name):
    """Forward and backward trace without a graph break (the training loop compiles each block; a break in the
    autograd.Function's backward, such as a torch.Generator, would run the whole layer eagerly)."""
    recipe = NVFP4Recipe.from_name(name, hadamard_seed=3)
    x = torch.randn(40, 64, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(48, 64, dtype=torch.bfloat16, requires_grad=True)
    y = torch.compile(lambda x, w: mx_linear(x, w, None, recipe), fullgraph=True)(x, w)
    y.sum().backward()
    assert x.grad.shape == x.shape and w.grad.shape == w.shape


# --- the cublas path (sm_100) on the CPU, through the layout-faithful emulator of torch._scaled_mm ---


@pytest.mark.parametrize("name", ["nvfp4_nearest_grads", "nvfp4_1d_weights", "nvfp4_no_rht"])
@pytest.mark.parametrize("rows", [64, 200])  # 200: token rows padded to 224 for the grad-weight GEMM
def test_cublas_path_matches_the_emulated_path(name, rows):
    """The three GEMMs through the emulator of the NVFP4 torch._scaled_mm (packed e2m1, blocked e4m3 scales read
    the way the hardware reads them) against the emulated path: the same quantized values, nearest rounding,
    equal up to the GEMMs' summation order and the emulated path's bf16 rounding before the decode scales."""
    from scaled_mm_emulator import nvfp4_scaled_mm

    from mx_recipe.ops.nvfp4_backends import NVFP4CublasBackend

    recipe = NVFP4Recipe.from_name(name, hadamard_seed=3, grad_rounding="nearest")
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 160, generator=generator).to(torch.bfloat16)  # K/16 = 10 scale columns, padded to 12
    w = (torch.randn(96, 160, generator=generator) * 0.1).to(torch.bfloat16)
    g = torch.randn(rows, 96, generator=generator).to(torch.bfloat16)
    calls = []

    def op(a, b, scale_a, scale_b, out_dtype):
        calls.append((tuple(a.shape), tuple(b.shape)))
        return nvfp4_scaled_mm(a, b, scale_a, scale_b, out_dtype)

    results = []
    for backend in (None, NVFP4CublasBackend(scaled_mm=op)):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = mx_linear(xr, wr, None, recipe, backend)
        y.backward(g)
        results.append((y, xr.grad, wr.grad))
    half_m = (rows + -rows % 32) // 2  # token rows padded to 32 for the grad-weight GEMM, two e2m1 a byte
    assert calls == [((rows, 80), (80, 96)), ((rows, 48), (48, 160)), ((96, half_m), (half_m, 160))]
    for what, got, want in zip(("y", "gx", "gw"), results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2 * want.abs().max().item(), msg=what)


def test_cublas_path_errors_and_selection():
    from mx_recipe.ops import pretend_capability
    from mx_recipe.ops.backends import resolve_backend
    from mx_recipe.ops.nvfp4_backends import NVFP4CublasBackend, NVFP4EmulatedBackend

    cpu = torch.device("cpu")
    assert isinstance(resolve_backend(NVFP4Recipe(), cpu), NVFP4EmulatedBackend)  # auto off sm_100: emulated
    # on sm_100 auto takes cublas for dense linears and stays emulated for MoE experts; 'emulated' stays emulated
    with pretend_capability((10, 0)):
        cuda = torch.device("cuda")
        assert isinstance(resolve_backend(NVFP4Recipe(), cuda), NVFP4CublasBackend)
        assert isinstance(resolve_backend(NVFP4Recipe(), cuda, grouped=True), NVFP4EmulatedBackend)
        assert isinstance(resolve_backend(NVFP4Recipe(backend="emulated"), cuda), NVFP4EmulatedBackend)
        with pytest.raises(ValueError, match="no NVFP4 grouped GEMM"):
            resolve_backend(NVFP4Recipe(backend="cublas"), cuda, grouped=True)
    with pytest.raises(ValueError, match=r"backend 'cublas' needs .*sm_100"):
        resolve_backend(NVFP4Recipe(backend="cublas"), cpu)
    with pytest.raises(ValueError, match="divisible by 32"):
        mx_linear(torch.randn(8, 48), torch.randn(32, 48), None, NVFP4Recipe(), NVFP4CublasBackend())


@pytest.mark.parametrize("path", ["emulated", "cublas"])
def test_forward_saves_x_along_m_and_not_x(path):
    """x is read in forward only: its grad-weight operand (along M, after the Hadamard transform) is formed
    there and saved instead of x, with the same gradients as the reference pieces; a frozen weight saves
    nothing of x at all."""
    from scaled_mm_emulator import nvfp4_scaled_mm

    from mx_recipe.ops.nvfp4_backends import NVFP4CublasBackend

    recipe = NVFP4Recipe.from_name("nvfp4_nearest_grads", hadamard_seed=3)
    backend = NVFP4CublasBackend(scaled_mm=nvfp4_scaled_mm) if path == "cublas" else None
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(40, 64, generator=generator).to(torch.bfloat16)
    w = (torch.randn(64, 64, generator=generator) * 0.1).to(torch.bfloat16)
    g = torch.randn(40, 64, generator=generator).to(torch.bfloat16)
    expected = _expected(x, w, g, recipe, seed=0)
    for train_w in (True, False):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_(train_w)
        saved: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t, saved=saved: saved.append(t) or t, lambda t: t):
            y = mx_linear(xr, wr, None, recipe, backend)
        assert not any(t.untyped_storage().data_ptr() == xr.untyped_storage().data_ptr() for t in saved)
        y.backward(g)
        assert len(saved) == ((3 if path == "emulated" else 4) if train_w else 1)  # w, and x along M and s_dec
        if path == "emulated":  # the cublas path sums in fp32 (test above)
            assert torch.equal(xr.grad, expected[1])
            assert not train_w or torch.equal(wr.grad, expected[2])
