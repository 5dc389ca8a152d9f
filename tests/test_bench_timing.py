"""benchmarks/timing.py's round logic on the CPU, with do_bench and the profiler replaced by a clock
that drifts: the interleaving must put the drift on every variant alike."""

import subprocess
import sys

import pytest
import torch
from script_module import BENCHMARKS, REPO, load_benchmark


def _bench_timing():
    return load_benchmark("timing")


class DriftingGPU:
    """Each timed call of a step costs its base time times a slowdown that grows by 1% per call."""

    def __init__(self, base_ms: dict[str, float]):
        self.base_ms, self.calls, self.order = base_ms, 0, []

    def do_bench(self, fn, warmup=25, rep=100, grad_to_none=None, return_mode="mean"):
        name = fn()
        samples = []
        for _ in range(4):
            samples.append(self.base_ms[name] * (1 + 0.01 * self.calls))
            self.calls += 1
        if return_mode == "all":
            self.order.append(name)
            return samples
        return sum(samples) / len(samples)


def test_rounds_rotate_and_share_the_drift(monkeypatch):
    timing = _bench_timing()
    gpu = DriftingGPU({"bf16": 1.0, "mx": 1.1})
    monkeypatch.setattr(timing, "do_bench", gpu.do_bench)
    monkeypatch.setattr(timing, "kernel_us", lambda step, grad_to_none=None: {"bf16": 900.0, "mx": 950.0}[step()])
    result = timing.interleaved({"bf16": lambda: "bf16", "mx": lambda: "mx"}, rounds=4)
    assert gpu.order == ["bf16", "mx", "mx", "bf16", "bf16", "mx", "mx", "bf16"]
    # both sides sat at the same positions of the drift on average, so the ratio is the true 1.1; the
    # same rounds without the rotation give 1.14, and all of bf16 before all of mx 1.26
    assert result["mx"].wall_us / result["bf16"].wall_us == pytest.approx(1.1, rel=0.005)
    assert len(result["bf16"].round_us) == 4 and result["bf16"].spread > 0
    assert (result["bf16"].kernel_us, result["mx"].kernel_us) == (900.0, 950.0)


def test_rejects_bad_rounds():
    timing = _bench_timing()
    with pytest.raises(ValueError, match="rounds"):
        timing.interleaved({"a": lambda: None}, rounds=0)


def test_run_meta_names_the_device_and_the_commit(monkeypatch):
    timing = _bench_timing()
    monkeypatch.setenv("MX_GIT_COMMIT", "0123abc")
    meta = timing.run_meta(recipe="mxfp8")
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    assert (meta["device"], meta["commit"], meta["recipe"]) == (device, "0123abc", "mxfp8")
    assert set(meta) == {"device", "torch", "date", "commit", "command", "recipe"}


def test_the_command_leaves_out_where_the_result_went(monkeypatch):
    timing = _bench_timing()
    script = str(timing.Path(timing.__file__).parent / "bench_moe.py")
    monkeypatch.setattr(timing.sys, "argv", [script, "--out", "r.json", "--experts", "1", "4", "--out=s.json"])
    assert timing.command_line() == "python benchmarks/bench_moe.py --experts 1 4"


def test_end_increments_add_up_to_the_span_and_skip_overlap():
    """A kernel that ends inside an earlier one adds nothing; one that starts early (PDL) adds only past the end
    before it; a gap counts to the kernel after it; the sum is the first start to the last end."""
    timing = _bench_timing()
    spans = [("a", 10.0, 15.0), ("b", 12.0, 14.0), ("c", 13.0, 18.0), ("d", 20.0, 21.0)]
    assert timing.end_increments(spans) == [5.0, 0.0, 3.0, 3.0]
    assert sum(timing.end_increments(spans)) == 21.0 - 10.0
    assert timing.end_increments([]) == []


def test_repeated_run_finds_the_layers_of_a_step():
    """The embedding, three layers of four kernels (one twice in a layer), the last norm and the output layer:
    the layers are the longest run, at their own period, not at two layers' or one kernel's."""
    timing = _bench_timing()
    layer = ["norm", "gemv", "attention", "gemv"]
    assert timing.repeated_run(["embedding"] + layer * 3 + ["norm", "gemv"]) == (1, 4, 3)
    assert timing.repeated_run(["a", "b", "b", "c"]) == (1, 1, 2)
    assert timing.repeated_run(["a", "b", "c"])[2] == 1 and timing.repeated_run([])[2] == 1


GPU_ONLY = ["bench_cast", "bench_fp4_cast", "bench_gemm", "bench_host", "bench_linear", "bench_moe"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="what a machine without CUDA prints")
def test_gpu_benchmarks_say_they_need_cuda_on_a_cpu():
    """Each GPU-only benchmark, run with its defaults where there is no CUDA, ends with one line naming itself."""
    for name in GPU_ONLY:
        done = subprocess.run([sys.executable, str(BENCHMARKS / f"{name}.py")], cwd=REPO, capture_output=True,
                              text=True, timeout=120)  # fmt: skip
        assert done.returncode == 1 and done.stderr.strip() == f"{name}.py needs a CUDA GPU", (name, done.stderr)
