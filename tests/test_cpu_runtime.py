"""The CPU backend as a process citizen: workspace bound, threads, fork, compilation and its cache.

Most checks run in a child process (``_python``), because they concern process-wide state:
Numba's threading layer, ``fork``, the kernel cache, warnings issued once per process.
"""

import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import threading
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

import dcn_cupy
from dcn_cupy import _geometry
from dcn_cupy._backends import cpu, cpu_channels_last, use_algorithm
from dcn_cupy._limits import format_size, parse_size

from cases import ARGUMENTS, random_case, relative_error
from child_process import run_python as _python
from snapshot import source_snapshot

REPO = Path(__file__).resolve().parent.parent
FULL = frozenset({"input", "weight", "offset", "mask"})

#: The CPU algorithms' modules (cpu/numba, cpu/channels-last): the same entry points, chunks and bound.
ALGORITHMS = [pytest.param(cpu, id="cpu/numba"), pytest.param(cpu_channels_last, id="cpu/channels-last")]


# A small float32 DCNv2 problem whose forward and backward every child process checks.
_PROBLEM = """
import numpy as np
import dcn_cupy

def problem(seed=0, batch=2):
    rng = np.random.default_rng(seed)
    f = np.float32
    x = rng.standard_normal((batch, 4, 7, 6)).astype(f)
    w = rng.standard_normal((6, 4, 3, 3)).astype(f)
    off = rng.uniform(-1.5, 1.5, (batch, 18, 7, 6)).astype(f)
    m = rng.uniform(0, 1, (batch, 9, 7, 6)).astype(f)
    gy = rng.standard_normal((batch, 6, 7, 6)).astype(f)
    return x, w, off, m, gy

def run(seed=0, batch=2):
    x, w, off, m, gy = problem(seed, batch)
    y = dcn_cupy.deform_conv2d(x, w, off, m, padding=1)
    g = dcn_cupy.deform_conv2d_backward(gy, x, w, off, m, padding=1)
    return [y, g.input, g.weight, g.offset, g.mask]

def check(results, seed=0, batch=2):
    from dcn_cupy import reference
    x, w, off, m, gy = (a.astype(np.float64) for a in problem(seed, batch))
    expected = reference.deform_conv(x, w, off, m, padding=1)
    assert np.abs(results[0] - expected).max() < 1e-4 * np.abs(expected).max(), "forward is wrong"
    assert all(np.isfinite(r).all() for r in results)
"""


# ---------------------------------------------------------------------------------------------
# Sizes from the environment (dcn_cupy._limits)


@pytest.mark.parametrize("text, expected", [
    ("67108864", 64 * 2**20), ("512M", 512 * 2**20), ("2G", 2 * 2**30), ("64MiB", 64 * 2**20),
    ("1.5g", 3 * 2**29), (" 16 kb ", 16 * 2**10), ("1T", 2**40), (4096, 4096),
])
def test_parse_size(text, expected):
    assert parse_size(text, "X") == expected


@pytest.mark.parametrize("text", ["lots", "512 MB of RAM", "-1", "0", "", "1e9", "2GG"])
def test_parse_size_rejects_with_the_variable_name_and_what_it_accepts(text):
    with pytest.raises(ValueError, match=r"DCN_CUPY_CPU_WORKSPACE_BYTES must be a positive number of bytes, "
                                         r"optionally with a unit K, M, G or T .*512M"):
        parse_size(text, "DCN_CUPY_CPU_WORKSPACE_BYTES")


def test_format_size():
    assert format_size(100) == "100 bytes"
    assert format_size(64 * 2**20) == "64.0 MiB (67108864 bytes)"


def test_workspace_variable_is_read_per_call(monkeypatch):
    x = np.ones((1, 2, 5, 5))
    w = np.ones((3, 2, 3, 3))
    monkeypatch.setenv("DCN_CUPY_CPU_WORKSPACE_BYTES", "512M")
    assert cpu.workspace_limit() == 512 * 2**20
    np.testing.assert_allclose(dcn_cupy.deform_conv2d(x, w), np.full((1, 3, 3, 3), 18.0))
    monkeypatch.setenv("DCN_CUPY_CPU_WORKSPACE_BYTES", "a lot")
    with pytest.raises(ValueError, match="DCN_CUPY_CPU_WORKSPACE_BYTES must be .* got 'a lot'"):
        dcn_cupy.deform_conv2d(x, w)


# ---------------------------------------------------------------------------------------------
# Workspace bound


class _ChunkSpy:
    """Records the workspaces and chunks the backend uses."""

    def __init__(self, monkeypatch):
        self.spaces, self.boxes = [], 0
        original = cpu._Workspace.chunks
        spy = self

        def chunks(space):
            spy.spaces.append(space)
            for chunk in original(space):
                spy.boxes += not chunk.all_positions
                yield chunk

        monkeypatch.setattr(cpu._Workspace, "chunks", chunks)


@pytest.mark.parametrize("algorithm", ["cpu/numba", "cpu/channels-last"])
@pytest.mark.parametrize("ndim", [1, 2, 3])
@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transpose"])
def test_chunks_within_a_sample_give_the_same_results(ndim, transposed, algorithm, monkeypatch):
    with use_algorithm(algorithm):
        _chunks_within_a_sample_give_the_same_results(ndim, transposed, monkeypatch)


def _chunks_within_a_sample_give_the_same_results(ndim, transposed, monkeypatch):
    rng = np.random.default_rng(30 + ndim)
    case = random_case(rng, ndim, transposed, batch=2)
    grad_output = rng.standard_normal(case.reference().shape)
    spy = _ChunkSpy(monkeypatch)
    y = case.forward(**case.arrays(), **case.params)
    grads = case.backward(grad_output, **case.arrays(), **case.params)
    assert spy.boxes == 0
    # A limit that holds about three output positions of one sample: chunks are boxes of positions.
    limit = max(s.per_sample + 3 * s.per_position for s in spy.spaces)
    monkeypatch.setattr(cpu, "WORKSPACE_LIMIT_BYTES", limit)
    y_boxed = case.forward(**case.arrays(), **case.params)
    grads_boxed = case.backward(grad_output, **case.arrays(), **case.params)
    assert spy.boxes >= 4, "the small limit did not chunk within a sample"
    assert all(s.bytes <= s.limit for s in spy.spaces), [(s.bytes, s.limit, s.samples, s.box_positions) for s in spy.spaces]
    assert relative_error(y_boxed, case.reference()) < 1e-12
    np.testing.assert_allclose(y_boxed, y, rtol=1e-12, atol=1e-12)
    for name in ARGUMENTS:
        np.testing.assert_allclose(getattr(grads_boxed, name), getattr(grads, name), rtol=1e-11, atol=1e-11)


def _geometry_of(x, w, off, m, **params):
    geom, _ = _geometry.conv_geometry(x.shape, w.shape, off.shape, m.shape, None, params.get("stride", 1),
                                      params.get("padding", 0), 1, 1, ndim=x.ndim - 2)
    return geom


def _traced_peak(fn):
    """(result, peak bytes NumPy allocated during ``fn()`` beyond what it held before)."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        result = fn()
        return result, tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()


def _problem(rng, batch, channels, size, dtype=np.float64):
    x = rng.standard_normal((batch, channels, size, size)).astype(dtype)
    w = rng.standard_normal((channels, channels, 3, 3)).astype(dtype)
    off = rng.uniform(-2, 2, (batch, 18, size, size)).astype(dtype)
    m = rng.uniform(0, 1, (batch, 9, size, size)).astype(dtype)
    return x, w, off, m


@pytest.mark.parametrize("module", ALGORITHMS)
@pytest.mark.parametrize("limit", [64 * 2**10, 256 * 2**10, 2**20])
def test_workspace_stays_within_the_limit(limit, module, monkeypatch):
    """Peak memory NumPy allocates during a call, less the outputs, is at most the limit."""
    rng = np.random.default_rng(5)
    x, w, off, m = _problem(rng, 3, 16, 20)
    geom = _geometry_of(x, w, off, m, padding=1)
    gy = rng.standard_normal(geom.y_shape)
    monkeypatch.setattr(cpu, "WORKSPACE_LIMIT_BYTES", limit)
    module.conv_forward(x, w, off, m, None, geom)  # compiled before tracing
    y, peak = _traced_peak(lambda: module.conv_forward(x, w, off, m, None, geom))
    slack = 32 * 2**10  # index arrays of the geometry, Python objects
    assert peak - y.nbytes <= limit + slack, (format_size(peak - y.nbytes), format_size(limit))
    grads, peak = _traced_peak(lambda: module.conv_backward(gy, x, w, off, m, geom, FULL))
    outputs = sum(g.nbytes for g in grads)
    assert peak - outputs <= limit + slack, (format_size(peak - outputs), format_size(limit))


@pytest.mark.parametrize("module", ALGORITHMS)
def test_impossible_request_is_refused_before_anything_is_allocated(module, monkeypatch):
    rng = np.random.default_rng(6)
    x, w, off, m = _problem(rng, 2, 64, 12)
    geom = _geometry_of(x, w, off, m, padding=1)
    monkeypatch.setenv("DCN_CUPY_CPU_WORKSPACE_BYTES", "4K")
    pattern = (r"needs at least \d+\.\d KiB \(\d+ bytes\) of workspace for one output position .* "
               r"over the limit of 4\.0 KiB \(4096 bytes\); raise DCN_CUPY_CPU_WORKSPACE_BYTES")
    tracemalloc.start()
    try:
        with pytest.raises(MemoryError, match=pattern):
            module.conv_forward(x, w, off, m, None, geom)
        with pytest.raises(MemoryError, match=pattern):
            module.conv_backward(x, x, w, off, m, geom, FULL)
        assert tracemalloc.get_traced_memory()[1] < 64 * 2**10
    finally:
        tracemalloc.stop()
    with pytest.raises(MemoryError, match="over the limit of 4.0 KiB"):
        dcn_cupy.deform_conv2d(x, w, off, m, padding=1)


@pytest.mark.parametrize("module", ALGORITHMS)
def test_broadcast_batch_is_not_copied_whole(module):
    rng = np.random.default_rng(7)
    one = _problem(rng, 1, 8, 24)
    batch = 64
    x, off, m = (np.broadcast_to(a, (batch,) + a.shape[1:]) for a in (one[0], one[2], one[3]))
    w = one[1]
    assert x.strides[0] == 0
    geom = _geometry_of(x, w, off, m, padding=1)
    gy = rng.standard_normal(geom.y_shape)
    dense = [np.ascontiguousarray(a) for a in (x, off, m)]
    # A limit of about two samples: the batch is gathered chunk by chunk, never as a whole.
    limit = x.nbytes // 4
    module.conv_forward(x, w, off, m, None, geom)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu, "WORKSPACE_LIMIT_BYTES", limit)
        y, peak = _traced_peak(lambda: module.conv_forward(x, w, off, m, None, geom))
    assert peak - y.nbytes <= limit + 32 * 2**10, format_size(peak)
    assert peak - y.nbytes < x.nbytes // 2, format_size(peak)
    # The limit cuts each sample's positions in two boxes, and the forward's GEMMs get other rows
    # than the whole grid's (cpu/channels-last's parts), which may move BLAS's last bits.
    np.testing.assert_allclose(y, module.conv_forward(dense[0], w, dense[1], dense[2], None, geom),
                               rtol=1e-12, atol=1e-12)
    for sample in y[1:]:
        np.testing.assert_array_equal(sample, y[0])
    grads = module.conv_backward(gy, x, w, off, m, geom, FULL)
    for got, expected in zip(grads, module.conv_backward(gy, dense[0], w, dense[1], dense[2], geom, FULL)):
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("channels, offset_groups, mask_groups, groups",
                         [(1, 1, 1, 1), (64, 1, 1, 1), (24, 3, 4, 2), (24, 12, 1, 8), (30, 5, 3, 2), (16, 16, 16, 16)])
def test_channel_runs_follow_every_group(channels, offset_groups, mask_groups, groups):
    """cpu/channels-last's runs of channels: consecutive, covering every channel once, each run
    the longest stretch of channels that share a conv, an offset and a mask group, with those
    groups and the conv group's first channel."""
    runs = cpu_channels_last._channel_runs(channels, offset_groups, mask_groups, groups)
    assert runs.dtype == np.uint64 and runs.flags.c_contiguous and not runs.flags.writeable and runs.shape[1] == 6
    owner = [(c * groups // channels, c * offset_groups // channels, c * mask_groups // channels)
             for c in range(channels)]
    expected = []
    for c in range(channels):
        if c == 0 or owner[c] != owner[c - 1]:
            g, o, m = owner[c]
            expected.append([c, c + 1, g, o, m, g * (channels // groups)])
        else:
            expected[-1][1] = c + 1
    np.testing.assert_array_equal(runs, np.array(expected, dtype=np.uint64))


# ---------------------------------------------------------------------------------------------
# Compilation


def test_read_only_arrays_use_the_same_compilation():
    rng = np.random.default_rng(8)
    x, w, off, m = _problem(rng, 2, 4, 6, np.float32)
    gy = rng.standard_normal((2, 4, 6, 6)).astype(np.float32)
    y = dcn_cupy.deform_conv2d(x, w, off, m, padding=1)
    grads = dcn_cupy.deform_conv2d_backward(gy, x, w, off, m, padding=1)
    kernels = {name: cpu._compiled_kernel(name, np.float32, np.uint32) for name in cpu._KERNELS}
    for a in (x, w, off, m, gy):
        a.flags.writeable = False
    y_ro = dcn_cupy.deform_conv2d(x, w, off, m, padding=1)
    grads_ro = dcn_cupy.deform_conv2d_backward(gy, x, w, off, m, padding=1)
    np.testing.assert_array_equal(y_ro, y)
    for name in ARGUMENTS:
        np.testing.assert_array_equal(getattr(grads_ro, name), getattr(grads, name))
    for name, kernel in kernels.items():
        assert len(kernel.overloads) == 1, (name, list(kernel.overloads))
        assert cpu._compiled_kernel(name, np.float32, np.uint32) is kernel


def test_cache_location_follows_the_environment(monkeypatch, tmp_path):
    for name in ("DCN_CUPY_NUMBA_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(cpu.numba.config, "CACHE_DIR", "")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cpu.cache_location() == str(tmp_path / "home" / ".cache" / "dcn_cupy" / "numba")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cpu.cache_location() == str(tmp_path / "xdg" / "dcn_cupy" / "numba")
    monkeypatch.setattr(cpu.numba.config, "CACHE_DIR", str(tmp_path / "numba"))
    assert cpu.cache_location() == str(tmp_path / "numba")
    monkeypatch.setenv("DCN_CUPY_NUMBA_CACHE", str(tmp_path / "mine"))
    assert cpu.cache_location() == str(tmp_path / "mine")
    monkeypatch.setenv("DCN_CUPY_NUMBA_CACHE", "0")
    assert cpu.cache_location() is None
    package = Path(cpu.__file__).resolve().parent
    monkeypatch.delenv("DCN_CUPY_NUMBA_CACHE")
    monkeypatch.setattr(cpu.numba.config, "CACHE_DIR", "")
    assert not Path(cpu.cache_location()).resolve().is_relative_to(package.parent)


def _cache_files(folder):
    return sorted(p.name for p in Path(folder).rglob("*") if p.suffix in (".nbi", ".nbc"))


_COMPILE_ONCE = _PROBLEM + """
import warnings, time
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    tic = time.perf_counter()
    results = run()
    print("seconds", round(time.perf_counter() - tic, 2))
check(results)
from dcn_cupy._backends.cpu import CompilationWarning
for w in caught:
    print("WARNING", w.category.__name__, w.message)
"""


@pytest.mark.slow
def test_first_compilation_warns_once_and_caches_outside_the_source_tree(tmp_path):
    """An empty cache: one CompilationWarning, files in $XDG_CACHE_HOME/dcn_cupy/numba only; the
    next process loads them silently. DCN_CUPY_NUMBA_CACHE=0 writes nothing."""
    package = REPO / "dcn_cupy"
    before = {p: p.stat().st_mtime for p in package.rglob("*") if p.suffix in (".nbi", ".nbc")}
    env = {"HOME": str(tmp_path / "home"), "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    first = _python(_COMPILE_ONCE, env=env).stdout
    warnings_ = [line for line in first.splitlines() if line.startswith("WARNING")]
    assert len(warnings_) == 1 and "CompilationWarning" in warnings_[0], first
    assert "compiling its CPU kernels for float32" in warnings_[0] and "cached in" in warnings_[0]
    folder = tmp_path / "xdg" / "dcn_cupy" / "numba"
    assert len(_cache_files(folder)) >= 8, _cache_files(tmp_path)
    assert not (tmp_path / "home").exists()
    after = {p: p.stat().st_mtime for p in package.rglob("*") if p.suffix in (".nbi", ".nbc")}
    assert after == before, "the Numba cache was written into the source tree"
    second = _python(_COMPILE_ONCE, env=env).stdout
    assert "WARNING" not in second, second

    env = {"HOME": str(tmp_path / "home2"), "XDG_CACHE_HOME": str(tmp_path / "xdg2"), "DCN_CUPY_NUMBA_CACHE": "0"}
    off = _python(_COMPILE_ONCE, env=env).stdout
    assert "not cached" in off, off
    assert not (tmp_path / "xdg2").exists() and not (tmp_path / "home2").exists()


# ---------------------------------------------------------------------------------------------
# Read-only installation


def _read_only(command, folders):
    """``command`` with ``folders`` read-only: chmod, and for root (whom chmod does not stop) read-only
    bind mounts in a private mount namespace."""
    for folder in folders:
        subprocess.run(["chmod", "-R", "a-w", str(folder)], check=True)
    if os.geteuid() != 0:
        return command
    if shutil.which("unshare") is None:
        pytest.skip("running as root without unshare: cannot make a folder read-only for root")
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"running as root and unshare --mount fails: {probe.stderr.decode().strip()}")
    mounts = " && ".join(f"mount --bind {f} {f} && mount -o remount,bind,ro {f}" for f in folders)
    import shlex
    return ["unshare", "--mount", "sh", "-c", f"{mounts} && exec {shlex.join(command)}"]


@pytest.mark.slow
def test_read_only_install_without_cache_folder_works(tmp_path):
    """pip install the package (not editable) into a venv, make it and $HOME read-only: forward and
    backward work, compiled in memory, with one warning about the cache."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    parent = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "_parent_environment.pth").write_text("".join(f"{p}\n" for p in sorted(parent)))
    source = source_snapshot(tmp_path / "src")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_REQUIRE_VIRTUALENV")}
    def pip(python_, *args):
        done = subprocess.run([str(python_), "-m", "pip", *map(str, args), "-q", "--disable-pip-version-check"],
                              env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
        assert done.returncode == 0, done.stdout + done.stderr

    pip(sys.executable, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", tmp_path / "wheels", source)
    pip(python, "install", "--no-deps", "--no-index", *sorted((tmp_path / "wheels").glob("dcn_cupy-*.whl")))
    installed = site / "dcn_cupy"
    assert (installed / "_backends" / "cpu.py").exists()
    home = tmp_path / "home"
    (home / ".cache").mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    code = _PROBLEM.replace("import dcn_cupy", "import dcn_cupy; assert dcn_cupy.__file__.startswith(%r)"
                            % str(site)) + _COMPILE_ONCE.split(_PROBLEM)[1]
    command = _read_only([str(python), "-c", textwrap.dedent(code)], [site, home])
    run_env = {k: v for k, v in env.items() if not k.startswith(("NUMBA_", "DCN_CUPY_", "XDG_"))}
    run_env.update(HOME=str(home), PYTHONDONTWRITEBYTECODE="1")
    try:
        result = subprocess.run(command, env=run_env, capture_output=True, text=True, timeout=600, cwd=elsewhere)
    finally:
        subprocess.run(["chmod", "-R", "u+w", str(tmp_path)], check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    warnings_ = [line for line in result.stdout.splitlines() if line.startswith("WARNING")]
    cache = [line for line in warnings_ if "cannot write its Numba kernel cache" in line]
    assert len(cache) == 1, result.stdout
    assert any("not cached" in line for line in warnings_), result.stdout
    assert not list(installed.rglob("*.nbi")) and not list(home.rglob("*.nbi"))


# ---------------------------------------------------------------------------------------------
# Threads, BLAS and fork


def _blas_threads():
    threadpoolctl = pytest.importorskip("threadpoolctl")
    return sorted((i["internal_api"], i["num_threads"]) for i in threadpoolctl.threadpool_info()
                  if i["user_api"] == "blas")


def test_concurrent_calls_leave_blas_as_found_and_match_serial_calls():
    threadpoolctl = pytest.importorskip("threadpoolctl")
    rng = np.random.default_rng(11)
    problems = []
    for seed in range(4):
        x, w, off, m = _problem(np.random.default_rng(seed), 2, 16, 14, np.float32)
        problems.append((x, w, off, m, rng.standard_normal((2, 16, 14, 14)).astype(np.float32)))

    def compute(p):
        x, w, off, m, gy = p
        y = dcn_cupy.deform_conv2d(x, w, off, m, padding=1)
        g = dcn_cupy.deform_conv2d_backward(gy, x, w, off, m, padding=1)
        return [y] + [getattr(g, name) for name in ARGUMENTS if getattr(g, name) is not None]

    serial = [compute(p) for p in problems]
    with threadpoolctl.threadpool_limits(limits=2, user_api="blas"):
        found = _blas_threads()
        if not found:
            pytest.skip("no BLAS library that threadpoolctl can see")
        results = [[] for _ in problems]
        errors = []
        barrier = threading.Barrier(len(problems))

        def worker(i):
            try:
                barrier.wait()
                for _ in range(3):
                    results[i].append(compute(problems[i]))
            except Exception as error:  # reported below
                errors.append(error)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(problems))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert _blas_threads() == found
    for i, expected in enumerate(serial):
        for repeat in results[i]:
            for got, want in zip(repeat, expected):
                np.testing.assert_array_equal(got, want)


def test_blas_limit_is_reference_counted():
    pytest.importorskip("threadpoolctl")
    found = _blas_threads()
    if not found:
        pytest.skip("no BLAS library that threadpoolctl can see")
    limiter = cpu._single_threaded_blas

    def held():  # the BLAS libraries loaded before the limiter's first use, NumPy's among them
        return [lib.num_threads for lib in limiter._controller.lib_controllers if lib.user_api == "blas"]

    with limiter:
        assert held() and all(n == 1 for n in held())
        with limiter:
            assert all(n == 1 for n in held())
        assert all(n == 1 for n in held()), "an inner exit must not restore the limits"
    assert _blas_threads() == found


_FORK = _PROBLEM + """
import multiprocessing, os
expected = run()
check(expected)

def child(seed):
    return run(seed)

if __name__ == "__main__":
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(2) as pool:
        out = pool.map_async(child, [0, 1, 2, 3]).get(timeout=120)
    for seed, results in enumerate(out):
        check(results, seed)
    for got, want in zip(out[0], expected):
        assert np.array_equal(got, want)
    print("FORK OK")
"""


def test_fork_after_use_computes_in_the_child():
    assert "FORK OK" in _python(_FORK, timeout=300).stdout


_DATALOADER = _PROBLEM + """
import torch
from torch.utils.data import DataLoader, Dataset
expected = run()

class Convolved(Dataset):
    def __len__(self):
        return 4
    def __getitem__(self, i):
        results = run(i, batch=1)
        check(results, i, batch=1)
        return torch.from_numpy(results[0][0])

if __name__ == "__main__":
    loader = DataLoader(Convolved(), batch_size=2, num_workers=2, multiprocessing_context="fork", timeout=120)
    batches = list(loader)
    assert len(batches) == 2 and batches[0].shape == (2, 6, 7, 6)
    assert np.array_equal(batches[0][0].numpy(), run(0, batch=1)[0][0])
    print("DATALOADER OK")
"""


def test_torch_dataloader_workers_after_use():
    pytest.importorskip("torch")
    assert "DATALOADER OK" in _python(_DATALOADER, timeout=300).stdout


_LAYER = _PROBLEM + """
import os, sys, threading, multiprocessing
import numba
from numba import njit, prange

@njit(parallel=True)
def users_own_kernel(a):
    total = 0.0
    for i in prange(a.shape[0]):
        total += a[i]
    return total

layer = os.environ["NUMBA_THREADING_LAYER"]
try:
    users_own_kernel(np.ones(1000))
except ValueError as error:  # "No threading layer could be loaded"
    print("UNAVAILABLE", error)
    sys.exit(0)
assert numba.threading_layer() == layer, numba.threading_layer()
expected = [run(seed) for seed in range(4)]
got = [None] * 4
errors = []

def worker(i):
    try:
        for _ in range(3):
            got[i] = run(i)
            users_own_kernel(np.ones(1000)) if layer != "workqueue" else None
    except Exception as error:
        errors.append(error)

threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
assert not errors, errors
for a, b in zip(got, expected):
    assert all(np.array_equal(x, y) for x, y in zip(a, b))

def child(seed):
    return run(seed)

if __name__ == "__main__":
    with multiprocessing.get_context("fork").Pool(2) as pool:
        out = pool.map_async(child, [0, 1]).get(timeout=120)
    assert all(np.array_equal(x, y) for x, y in zip(out[1], expected[1]))
    print("LAYER OK", layer)
"""


@pytest.mark.parametrize("layer", ["omp", "workqueue", "tbb"])
def test_works_from_threads_and_after_fork_with_every_threading_layer(layer):
    """Whatever layer the rest of the process uses (started first, by the user's own kernel),
    dcn_cupy runs from 4 threads at once and in forked children: it never enters the layer."""
    out = _python(_LAYER, env={"NUMBA_THREADING_LAYER": layer}, timeout=300).stdout
    if "UNAVAILABLE" in out:
        pytest.skip(f"Numba's {layer} threading layer does not load here: {out.strip()}")
    assert f"LAYER OK {layer}" in out, out


_FIRST_USE = _PROBLEM + """
import threading, warnings
warnings.simplefilter("always")
barrier = threading.Barrier(4)
got, errors = [None] * 4, []

def worker(i):
    try:
        barrier.wait()
        got[i] = run(i % 2)
    except Exception as error:
        errors.append(error)

with warnings.catch_warnings(record=True) as caught:
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
assert not errors, errors
for i in range(4):
    check(got[i], i % 2)
    assert all(np.array_equal(a, b) for a, b in zip(got[i], got[i % 2]))
names = [w.category.__name__ for w in caught]
assert names == ["CompilationWarning"], names
print("FIRST USE OK")
"""


def test_concurrent_first_use_compiles_once():
    """Four threads call at once in a process that has compiled nothing (no disk cache)."""
    out = _python(_FIRST_USE, env={"DCN_CUPY_NUMBA_CACHE": "0"}, timeout=300).stdout
    assert "FIRST USE OK" in out, out
