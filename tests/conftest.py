"""Shared fixtures: the places every op test runs on."""

# paddle 2.6 ships its own zlib; loading the system one first avoids a
# segfault in inflateReset2 (seen in to_static's source handling).
import zlib  # noqa: F401  isort: skip

import paddle
import pytest


def available_places():
    places = ["cpu"]
    if paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0:
        places.append("gpu")
    return places


PLACES = available_places()
PADDLE_MAJOR = int(paddle.__version__.split(".")[0])


def pytest_collection_modifyitems(config, items):
    if PADDLE_MAJOR >= 3:
        return
    skip = pytest.mark.skip(
        reason=f"needs paddle 3: paddle {paddle.__version__}'s to_static "
        "builds a backward pass for custom ops and fails"
    )
    for item in items:
        if "needs_paddle3" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=["cpu", "gpu"])
def place(request):
    if request.param not in PLACES:
        pytest.skip("no CUDA device: paddle is not compiled with CUDA or sees no GPU")
    paddle.set_device(request.param)
    yield request.param
    paddle.set_device("cpu")


def pytest_addoption(parser):
    parser.addoption(
        "--soak-steps",
        type=int,
        default=1500,
        help="engine steps of the soak test (default keeps it near a minute)",
    )


@pytest.fixture
def soak_steps(request):
    return request.config.getoption("--soak-steps")


def _on_path(path):
    """The CPU ops run on instruction-set ``path`` inside (skips where this CPU lacks it)."""
    from paddle_step.testing.cpu_paths import on_isa, runs_here

    if not runs_here(path):
        pytest.skip(f"this CPU has no {path} path")
    return on_isa(path)


@pytest.fixture(params=["scalar", "avx2", "avx512", "avx512_bf16"])
def isa_path(request):
    """Each instruction-set path of the CPU ops."""
    with _on_path(request.param):
        yield request.param


@pytest.fixture(params=["scalar", "avx2", "avx512"])
def float_isa_path(request):
    """Each path of the kernels that run float32 alone (AVX512-BF16 and VNNI change only
    the bfloat16 and int8 products: those kernels run the AVX-512 path there)."""
    with _on_path(request.param):
        yield request.param
