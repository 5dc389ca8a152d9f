"""docs/RESULTS.md and the parity summaries are exactly what scripts/results_report.py renders from
the committed run metrics (docs/results/*_parity_*/) and serving-quality outputs (*_weight_quality/); a
sweep's output becomes a set and its section."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _results_report():
    spec = importlib.util.spec_from_file_location("results_report", ROOT / "scripts" / "results_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_results_doc_and_summaries_match_the_run_metrics(tmp_path):
    report = _results_report()
    folders = report.parity_folders()
    assert folders, "no parity result folders under docs/results"
    out_of = {folder: tmp_path / folder.name for folder in folders}
    rendered = report.render(out_of)
    text = report.DOC.read_text()
    generated = text.split(report.BEGIN, 1)[1].split(report.END, 1)[0]
    assert generated == "\n" + rendered, "run: python scripts/results_report.py --write"
    for folder in folders:
        # PERFORMANCE.md's parity tables read the committed summary.json: it must be the fresh one.
        fresh = json.loads((out_of[folder] / "summary.json").read_text())
        assert json.loads((folder / "summary.json").read_text()) == fresh, folder.name
        assert (folder / "loss.png").stat().st_size < 1_000_000
        meta = json.loads((folder / "meta.json").read_text())
        assert meta["commit"] != "unknown" and meta["commands"]["all"].startswith("python scripts/parity_sweep.py")


def _synthetic_sweep(tmp_path: Path, commit: str = "abc1234") -> Path:
    """A parity_sweep.py output of made-up curves: bf16 and mxfp8 (+0.1%), three seeds each."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_compare_runs import SMALL_NOISE, write_sweep

    sweep = write_sweep(tmp_path / "sweep", {"bf16": ("none", 0.0, [0.0] * 5), "mxfp8": ("mxfp8", 0.001, SMALL_NOISE)},
                        seeds=3)  # fmt: skip
    for run in sweep.glob("*/seed*"):
        (run / "train.log").write_text("not kept\n")
    command = "python scripts/parity_sweep.py --config parity_llama1b --recipes none mxfp8 --seeds 0 1 2"
    invocation = {"command": command, "date": "2026-12-01T10:00:00+00:00", "commit": commit, "torch": "2.11.0"}
    invocation["device"] = "2 x NVIDIA H100"
    (sweep / "sweep.json").write_text(
        json.dumps({"config": "parity_llama1b", "overrides": [], "invocations": [invocation]})
    )
    return sweep


def test_a_sweep_becomes_a_set_and_its_section(tmp_path, capsys):
    report = _results_report()
    results = tmp_path / "repo" / "docs" / "results"
    results.mkdir(parents=True)
    folder = report.add_set(_synthetic_sweep(tmp_path), "llama1b", "three seeds on two GPUs", False, results)
    assert folder == results / "2026-12-01_h100_parity_llama1b"
    kept = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    runs = [f"{a}/seed{k}/{f}" for a in ("bf16", "mxfp8") for k in range(3) for f in ("config.toml", "metrics.jsonl")]
    assert kept == sorted([*runs, "meta.json"])
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["commands"]["all"].startswith("python scripts/parity_sweep.py") and meta["commit"] == "abc1234"
    rendered = report.render(results=results)
    assert rendered.startswith("### llama1b\n\nSource: `docs/results/2026-12-01_h100_parity_llama1b/`: 2 x NVIDIA H100")
    assert "three seeds on two GPUs." in rendered
    assert "**PARITY PASS: debug mxfp8 vs debug bf16: final val loss +0.1" in rendered
    assert "| debug bf16 (baseline) | 0, 1, 2 | 200 |" in rendered and "| debug mxfp8 | 0, 1, 2 | 200 |" in rendered
    assert "](results/2026-12-01_h100_parity_llama1b/loss.png)" in rendered and len(rendered) < 5000
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["arms"][1]["run_dirs"][0] == "docs/results/2026-12-01_h100_parity_llama1b/mxfp8/seed0"
    doc = tmp_path / "RESULTS.md"
    doc.write_text(f"# Results\n\n{report.BEGIN}\nold\n{report.END}\nafter\n")
    report.write_doc(rendered, doc)
    assert doc.read_text() == f"# Results\n\n{report.BEGIN}\n{rendered}{report.END}\nafter\n"
    # The same kind again: refused, or replaced.
    again = _synthetic_sweep(tmp_path / "again")
    with pytest.raises(SystemExit, match="holds a set of the same kind: pass --replace"):
        report.add_set(again, "llama1b", None, False, results)
    report.add_set(again, "llama1b", None, True, results)
    assert "removed" in capsys.readouterr().out and len(report.parity_folders(results)) == 1


def test_a_sweep_of_uncommitted_code_is_refused(tmp_path):
    report = _results_report()
    sweep = _synthetic_sweep(tmp_path, commit="abc1234 (with uncommitted changes)")
    with pytest.raises(SystemExit, match="results need a committed tree"):
        report.add_set(sweep, "llama1b", None, False, tmp_path)


def test_results_doc_serving_quality_matches_its_sets():
    report = _results_report()
    folders = report.quality_folders()
    assert folders, "no serving-quality folders under docs/results"
    text = report.DOC.read_text()
    generated = text.split(report.QUALITY_BEGIN, 1)[1].split(report.QUALITY_END, 1)[0]
    assert generated == "\n" + report.render_quality(), "run: python scripts/results_report.py --write"
    for folder in folders:
        meta = report.quality_meta(folder)  # one device, torch, date and commit per set
        assert ";" not in meta["device"] + meta["torch"] + meta["date"] + meta["commit"], folder.name
        assert meta["command"].startswith("python scripts/weight_quality.py --checkpoint RUN")
        assert [report.trained_as(run) for run in report.quality_runs(folder)][0] == "bf16"


def _quality_output(path: Path, recipe: str, losses: dict, commit: str = "abc1234") -> None:
    """A scripts/weight_quality.py --out file of made-up losses, keyed (weights, activations[, output layer])."""
    checkpoint = f"/tmp/q_{recipe}"
    meta = dict(device="NVIDIA H100", torch="2.11.0", date="2026-12-01T10:00:00+00:00", commit=commit)
    meta |= dict(command=f"python scripts/weight_quality.py --checkpoint {checkpoint} --activations --steps 5")
    meta |= dict(checkpoint=checkpoint, recipe=recipe, steps=5)
    base = losses["bf16", "bf16"]
    rows = []
    for key, loss in losses.items():
        rows.append(dict(weights=key[0], activations=key[1], loss=loss, vs_bf16=loss / base - 1))
        if len(key) == 3:  # sets written before --quantize-output hold no output_layer
            rows[-1]["output_layer"] = key[2]
    path.write_text(json.dumps(dict(meta=meta, rows=rows)))


def test_a_serving_quality_set_is_one_table_a_column_pair_per_checkpoint(tmp_path):
    report = _results_report()
    folder = tmp_path / "repo" / "docs" / "results" / "2026-12-01_h100_weight_quality"
    folder.mkdir(parents=True)
    losses = {("bf16", "bf16"): 2.0, ("mxfp4", "bf16"): 2.002, ("mxfp4", "mx"): 2.01}
    losses |= {("mxfp4", "bf16", "quantized"): 2.003}
    _quality_output(folder / "mxfp8_trained.json", "mxfp8", losses | {("bf16", "bf16"): 2.1})
    _quality_output(folder / "bf16_trained.json", "none", losses)
    assert report.quality_folders(folder.parent) == [folder]
    text = report.render_quality(folder.parent)
    rendered = text.splitlines()
    assert text.endswith(" |\n")  # the end marker on a line of its own
    assert rendered[0].startswith("Source: `docs/results/2026-12-01_h100_weight_quality/`: NVIDIA H100, torch 2.11.0")
    assert "torch 2.11.0, 2026-12-01, commit abc1234." in rendered[0]
    command = "`python scripts/weight_quality.py --checkpoint RUN --activations --steps 5`"
    assert rendered[0].endswith(f"Command on each checkpoint (RUN: its run's output folder): {command}.")
    assert rendered[2:] == [
        "| weights | output layer | GEMM inputs | bf16-trained loss | to bf16 weights | mxfp8-trained loss | to bf16 "
        "weights |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: |",
        "| bf16 (baseline) | bf16 | bf16 | 2.0000 |  | 2.1000 |  |",
        "| mxfp4 | bf16 | bf16 | 2.0020 | +0.100% | 2.0020 | -4.667% |",
        "| mxfp4 | bf16 | mxfp4 | 2.0100 | +0.500% | 2.0100 | -4.286% |",
        "| mxfp4 | mxfp4 | bf16 | 2.0030 | +0.150% | 2.0030 | -4.619% |",
    ]
    doc = tmp_path / "RESULTS.md"
    doc.write_text(f"{report.QUALITY_BEGIN}\nold\n{report.QUALITY_END}\n{report.BEGIN}\nkept\n{report.END}\n")
    report.write_doc(text, doc, report.QUALITY_BEGIN, report.QUALITY_END)
    assert doc.read_text().startswith(f"{report.QUALITY_BEGIN}\n{rendered[0]}\n") and "\nkept\n" in doc.read_text()
