"""Markers: `gpu` tests need CUDA, `sm100` tests need a Blackwell GPU; both skip cleanly elsewhere. Fixtures:
``one_thread``, and ``pretend_gpu`` (a compute capability for CUDA devices, on any machine)."""

import contextlib
import os

# Under pytest-xdist each worker takes its share of the cores for torch's CPU threads (the GPU tests' CPU
# references), set before torch is imported: with torch's default every worker spreads over all the host's cores,
# and the workers' threads contend for them.
if "PYTEST_XDIST_WORKER" in os.environ and "OMP_NUM_THREADS" not in os.environ:
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // _workers))

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture
def one_thread():
    """One intra-op thread, for tests of small tensors: more threads only add contention on a busy host."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _has_sm100() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (10, 0)


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_sm100 = pytest.mark.skip(reason="needs an sm_100 (Blackwell) GPU")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if "sm100" in item.keywords and not _has_sm100():
            item.add_marker(skip_sm100)


@pytest.fixture
def pretend_gpu():
    """``pretend_gpu((10, 0))``: every CUDA device reports that compute capability until the test ends (None: not
    an NVIDIA GPU), through ``mx_recipe.ops.pretend_capability``: what would run on that GPU."""
    from mx_recipe.ops import pretend_capability

    with contextlib.ExitStack() as stack:
        yield lambda capability: stack.enter_context(pretend_capability(capability))
