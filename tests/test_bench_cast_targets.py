"""benchmarks/bench_cast.py judges the >= 90% target on the MX casts only; the emulated path's fake-quants get a
line of their own (CPU: the judging, on made-up rows)."""

from script_module import load_benchmark


def test_slowest_cast_leaves_out_fake_quants_copies_and_baselines(capsys):
    bench = load_benchmark("bench_cast")
    res = bench.Results((4000.0, 4000.0))
    gb = 400_000_000  # bytes moved: 100 us is 4000 GB/s, 100% of copy

    def add(name, kernel_us, mode="floor"):
        res.add(name, (8, 8), mode, (0.1, kernel_us / 1e3), gb)

    add("dim0", 100.0)
    add("3d dim1 blocked", 110.0)  # the slowest cast: 90.9%
    add("fq along M", 125.0)  # slower still, a fake-quant: 80%
    add("copy (same size)", 200.0, "-")
    add("dim0 + dim1 separate", 300.0)
    add("fq dim0 + along M separate", 300.0)
    for name in (
        "dim0_dim1 fused",
        "dim0 + dim1 separate blocked",
        "dim0_dim1 fused blocked",
        "fq dim0 + along M fused",
    ):
        add(name, 100.0)
    lines = bench.check_targets(res, [], 8, 8, ["floor"])
    assert "slowest cast (kernels): 3d dim1 blocked (8, 8) floor at 90.9% of copy (target >= 90%)" in lines
    assert "slowest fake-quant (kernels): fq along M (8, 8) floor at 80.0% of copy" in lines
    assert [r["name"] for r in res.casts()] == ["dim0", "3d dim1 blocked"] + [
        "dim0_dim1 fused",
        "dim0_dim1 fused blocked",
    ]
    assert {r["name"] for r in res.casts(fake_quant=True)} == {"fq along M", "fq dim0 + along M fused"}
    capsys.readouterr()
