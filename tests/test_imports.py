"""The package structure (docs/DESIGN.md, Architecture): every module of mx_recipe and mx_kernels imports on its own
in a fresh interpreter, mx_kernels never imports mx_recipe, its leaf spec imports nothing but torch, and
``import mx_recipe`` pulls in neither the model zoo nor Triton."""

from __future__ import annotations

import importlib.util
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import mx_recipe

ROOT = Path(__file__).resolve().parents[1]
HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_TORCHTITAN = importlib.util.find_spec("torchtitan") is not None  # a dev extra; absent on the GPU image


def _modules(package: str) -> list[str]:
    spec = importlib.util.find_spec(package)
    names = [package]
    for info in pkgutil.walk_packages(spec.submodule_search_locations, prefix=f"{package}."):
        names.append(info.name)
    return sorted(names)


def _fresh_import(module: str) -> list[str]:
    """Import ``module`` in a new interpreter; the modules of both packages (and triton) it loaded."""
    code = (
        f"import importlib, json, sys; importlib.import_module({module!r}); "
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('mx_recipe', 'mx_kernels', 'triton'))))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"import {module} failed in a fresh interpreter:\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_module_imports_alone_and_kernels_never_import_mx_recipe():
    """One interpreter per module, all at once (a few seconds each, in parallel on the CI's cores)."""
    modules = _modules("mx_recipe") + _modules("mx_kernels")
    if not HAS_TRITON:  # the kernel modules need triton; the rest must import without it
        modules = [m for m in modules if m.split(".")[0] == "mx_recipe" or m in ("mx_kernels", "mx_kernels.spec")]
    if not HAS_TORCHTITAN:
        modules = [m for m in modules if not m.startswith("mx_recipe.integrations.torchtitan")]
    else:  # one torchtitan line is installed: the other line's modules refuse to import, by design
        line_02 = importlib.util.find_spec("torchtitan.protocols.model_converter") is not None
        other = ("converters", "config_registry") if line_02 else ("registered", "train")
        modules = [m for m in modules if m not in {f"mx_recipe.integrations.torchtitan.{name}" for name in other}]
    code = "import importlib, sys; importlib.import_module(sys.argv[1])"
    procs = {m: subprocess.Popen([sys.executable, "-c", code, m], cwd=ROOT, stderr=subprocess.PIPE, text=True)
             for m in modules}  # fmt: skip
    failed = {m: p.communicate(timeout=600)[1][-1500:] for m, p in procs.items() if p.wait(timeout=600) != 0}
    assert not failed, failed
    for module in ("mx_kernels.spec", "mx_kernels.common", "mx_kernels.gluon.casts" if HAS_TRITON else "mx_kernels"):
        loaded = _fresh_import(module)
        assert not [m for m in loaded if m.startswith("mx_recipe")], f"{module} imports mx_recipe: {loaded}"


def test_spec_is_a_leaf():
    loaded = _fresh_import("mx_kernels.spec")
    assert loaded == ["mx_kernels", "mx_kernels.spec"], loaded


def test_import_mx_recipe_is_light_and_exports_the_api():
    loaded = _fresh_import("mx_recipe")
    assert "mx_recipe.models" not in loaded and "mx_recipe.train" not in loaded, loaded
    assert not [m for m in loaded if m.startswith("triton")], loaded
    for name in ("to_mx", "MXRecipe", "mx_linear", "MXLinear", "convert_to_mx", "mx_grouped_mm", "NVFP4Recipe"):
        assert name in mx_recipe.__all__ and callable(getattr(mx_recipe, name)), name
    for name in mx_recipe.__all__:  # `from mx_recipe import NAME` works for each, as the README's snippet does
        assert getattr(mx_recipe, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        mx_recipe.nope  # noqa: B018


def test_fresh_import_reports_failures():
    with pytest.raises(AssertionError, match="failed in a fresh interpreter"):
        _fresh_import("mx_recipe.does_not_exist")
    assert json.dumps(_modules("mx_kernels")).count("mx_kernels.spec") == 1


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
def test_installed_triton_is_the_tested_one():
    """pyproject bounds Triton to the release the kernels are tested with (pip would otherwise pick the newest,
    whose Gluon API differs); the environment running these tests must hold such a Triton."""
    import re

    import triton

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (spec,) = [d for d in deps if d.startswith("triton")]
    low, high = re.match(r"triton>=([\d.]+),<([\d.]+);", spec).groups()
    version = tuple(int(p) for p in triton.__version__.split(".")[:2])
    as_tuple = lambda v: tuple(int(p) for p in v.split(".")[:2])  # noqa: E731
    assert as_tuple(low) <= version < as_tuple(high), f"triton {triton.__version__} is outside {spec}"
