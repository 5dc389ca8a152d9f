"""The docs against the code: what README.md and docs/*.md state of checkable defaults, names, commands and
paths must be what the code has. Each check reads a marked phrase or table, not free prose, so that a
reworded sentence does not break it and a changed default does."""

import dataclasses
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
DOC_NAMES = ("DESIGN", "PERFORMANCE", "ROOFLINE", "RESULTS")


def text(path: Path) -> str:
    return path.read_text()


def table_rows(doc: str, header: str) -> list[list[str]]:
    """The cells of the markdown table whose header line starts with ``header``."""
    lines = doc.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def backticked(s: str) -> list[str]:
    """The inline code spans of ``s`` (fenced blocks left out)."""
    return re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", s, flags=re.S))


# --- the test command and its tiers ---


def readme_ci_command() -> str:
    """The README's setup block line marked as the CI tier."""
    line = next(line for line in text(README).splitlines() if "pytest" in line and "# the CI tier" in line)
    return line.split("#", 1)[0].strip()


def ci_run_command() -> str:
    """The pytest line of .ci/run (the main environment's; the torchtitan 0.2 tests run in another), its
    interpreter spelled as the README spells it."""
    lines = text(ROOT / ".ci" / "run").splitlines()
    line = [line for line in lines if line.strip().startswith("python3 -m pytest")][-1].strip()
    return re.sub(r"^python3 ", "python ", line)


@pytest.mark.xfail(
    text(ROOT / ".ci" / "run").rstrip().endswith("python3 -m pytest -q"),
    reason=".ci/run still runs the whole suite, not the CI tier",
    strict=True,
)
def test_readme_test_command_is_what_ci_runs():
    assert readme_ci_command() == ci_run_command()


def test_readme_test_tiers_use_declared_markers():
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib

    declared = {
        m.split(":")[0].strip()
        for m in tomllib.loads(text(ROOT / "pyproject.toml"))["tool"]["pytest"]["ini_options"]["markers"]
    }
    tiers = [c for c in backticked(text(README)) if c.startswith("python -m pytest")]
    assert readme_ci_command() in tiers and len(tiers) >= 4
    for command in tiers:
        args = shlex.split(command)
        if "-m" in args[3:]:
            expression = args[args.index("-m", 3) + 1]
            used = set(re.findall(r"\w+", expression)) - {"and", "or", "not"}
            assert used <= declared, f"{command}: markers {used - declared} are not declared in pyproject.toml"


# --- names the README lists ---


def test_readme_recipe_table_lists_every_recipe():
    from mx_recipe.formats.recipe import NVFP4_RECIPES, RECIPES

    listed = [backticked(row[0])[0] for row in table_rows(text(README), "| recipe |")]
    assert len(listed) == len(set(listed))
    assert set(listed) == set(RECIPES) | set(NVFP4_RECIPES)


def test_readme_model_flavors():
    from mx_recipe.models import MODEL_FLAVORS

    bullet = re.search(r"^- Models: (.*?)(?=^- |^$)", text(README), re.S | re.M).group(1)
    listed = {name: backticked(flavors) for name, flavors in re.findall(r"`(\w+)` \(([^)]*)\)", bullet)}
    assert listed == {name: list(flavors) for name, flavors in MODEL_FLAVORS.items()}


def test_readme_default_config():
    from mx_recipe.train.config import load_config

    stated = re.search(r"`python train.py` with no arguments [^(]*\(`([^`]+)`\)", text(README)).group(1)
    assert Path(load_config(None).source) == ROOT / stated


# --- defaults the docs state ---


def recipe_defaults() -> dict[str, object]:
    from mx_recipe.formats.recipe import MXRecipe, NVFP4Recipe

    defaults = {f.name: f.default for f in dataclasses.fields(NVFP4Recipe)}
    return defaults | {f.name: f.default for f in dataclasses.fields(MXRecipe)}


def config_section_defaults(section: str) -> dict[str, object]:
    from mx_recipe.train.config import load_config

    cfg = getattr(load_config(None), section)
    fields = dataclasses.fields(type(cfg))
    return {f.name: f.default_factory() if f.default is dataclasses.MISSING else f.default for f in fields}


ON_OFF = re.compile(r"`(\w+)`(?:,\s*| \()(on|off) by default")
SECTION_DEFAULT = re.compile(r"`(\w+)\.(\w+)` \(default `([^`]*)`\)")


def test_on_off_defaults_the_docs_state():
    """Statements like `name` (on by default) or `name`, off by default, against the recipes' fields."""
    defaults, checked = recipe_defaults(), set()
    for path in DOCS:
        for name, state in ON_OFF.findall(text(path)):
            assert name in defaults, f"{path.name}: `{name}` is stated on/off by default but is no recipe field"
            assert defaults[name] is (state == "on"), (
                f"{path.name}: `{name}` {state} by default, code: {defaults[name]}"
            )
            checked.add(name)
    assert {"fuse_x_casts", "share_input_casts", "fuse_expert_casts", "save_mx_input"} <= checked


def test_design_options_table_is_the_recipe_options():
    from mx_recipe.formats.recipe import MXRecipe

    rows = table_rows(text(ROOT / "docs" / "DESIGN.md"), "| option | default |")
    stated = {backticked(name)[0]: default for name, default, *_ in rows}
    options = {f.name: f.default for f in dataclasses.fields(MXRecipe) if isinstance(f.default, bool)}
    assert set(stated) == set(options), "DESIGN.md's options table and MXRecipe's boolean options differ"
    assert stated == {name: "on" if value else "off" for name, value in options.items()}


def test_config_key_defaults_the_docs_state():
    """Statements like `section.key` (default `value`) in the docs, against the training config's defaults."""
    checked = 0
    for path in DOCS:
        for section, key, value in SECTION_DEFAULT.findall(text(path)):
            defaults = config_section_defaults(section)
            assert key in defaults, f"{path.name}: `{section}.{key}` is no config key"
            assert str(defaults[key]) == value, f"{path.name}: `{section}.{key}` default {defaults[key]!r}, not {value}"
            checked += 1
    assert checked, "no `section.key` (default `value`) statement found"


# --- links, paths and section references ---


LINK = re.compile(r"\]\(([^)\s]+)\)")
PATH = re.compile(
    r"(?<![\w/.-])((?:scripts|benchmarks|configs|tests|docs|mx_recipe|mx_kernels|kernels)/[\w./{},*<>-]*)"
)
PLACEHOLDER = re.compile(r"[A-Z]{3,}|[*{<]")  # docs/results/DATE_DEVICE_..., configs/NAME.toml


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_relative_links_resolve(path):
    for target in LINK.findall(text(path)):
        if target.startswith(("http://", "https://", "#", "mailto:")):
            continue
        assert (path.parent / target.split("#")[0]).exists(), f"{path.name}: link {target} leads nowhere"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_named_paths_exist(path):
    for name in PATH.findall(text(path)):
        name = name.rstrip(".,:;")
        if PLACEHOLDER.search(name.split("/", 1)[1]):
            continue
        on_disk = ROOT / re.sub(r"^mx_kernels/", "kernels/", name)
        assert on_disk.exists(), f"{path.name} names {name}, which does not exist"


def headings(doc: str) -> list[str]:
    return [line.lstrip("#").strip() for line in doc.splitlines() if re.match(r"#{2,3} ", line)]


SECTION_REF = re.compile(r"\b(" + "|".join(DOC_NAMES) + r')\.md\s*[,(]\s*"?([A-Z][^"\n:;,)`]*)')


def test_section_references_name_existing_sections():
    """A reference such as `docs/DESIGN.md, Scale layout` in the code or the docs names a heading of that doc."""
    sources = [
        p
        for folder in ("mx_recipe", "kernels", "scripts", "benchmarks", "tests")
        for p in (ROOT / folder).rglob("*.py")
    ]
    found = 0
    for path in sources + DOCS:
        for doc, section in SECTION_REF.findall(text(path)):
            section = section.strip()
            titles = headings(text(ROOT / "docs" / f"{doc}.md"))
            assert any(t.startswith(section) for t in titles), (
                f"{path.relative_to(ROOT)}: {doc}.md has no section {section!r}"
            )
            found += 1
    assert found > 20


# --- the README's library snippet runs ---


def test_readme_library_snippet_runs(capsys):
    code = re.search(r"## The library\n\n```python\n(.*?)```", text(README), re.S).group(1)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    assert scope["y"].shape == (128, 512) and scope["out"].shape == (128, 64)
    assert "2 of 2 layers converted" in capsys.readouterr().out
