"""Plans: validated once, checked cheaply per call, cached for the functional API, forceable."""

import threading
from types import SimpleNamespace

import numpy as np
import pytest

import dcn_cupy
from dcn_cupy import _backends, _plan
from dcn_cupy._backends import use_algorithm

from cases import ARGUMENTS, random_case, relative_error


def _plan_of(case, arrays=None, **kw):
    arrays = case.arrays() if arrays is None else arrays
    params = dict(case.params)
    return dcn_cupy.plan(**arrays, **params, transposed=case.transposed, **kw)


@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transpose"])
@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_plan_equals_functional_and_reference(ndim, transposed):
    rng = np.random.default_rng(100 + ndim + 10 * transposed)
    case = random_case(rng, ndim, transposed)
    arrays = case.arrays()
    p = _plan_of(case)
    y = p.forward(**arrays)
    assert y.shape == p.output_shape
    np.testing.assert_array_equal(y, case.forward(**arrays, **case.params))
    assert relative_error(y, case.reference()) < 1e-10
    gy = rng.standard_normal(y.shape)
    grads = p.backward(gy, **arrays)
    expected = case.backward(gy, **arrays, **case.params)
    for name in ARGUMENTS:
        np.testing.assert_array_equal(getattr(grads, name), getattr(expected, name))
    only = p.backward(gy, **arrays, wrt={"weight", "bias"})
    assert only.input is None and only.offset is None and only.mask is None
    np.testing.assert_array_equal(only.weight, expected.weight)


def test_plan_from_specs_and_unbatched_arrays():
    rng = np.random.default_rng(3)
    case = random_case(rng, 2, False, batch=1)
    arrays = {k: None if a is None else (a[0] if k in ("input", "offset", "mask") else a)
              for k, a in case.arrays(lambda a: a.astype(np.float32)).items()}
    specs = {k: None if a is None else SimpleNamespace(shape=a.shape, dtype=a.dtype) for k, a in arrays.items()}
    p = dcn_cupy.plan(**specs, **case.params, device="cpu")
    y = p.forward(**arrays)
    assert y.shape == p.output_shape == case.reference().shape[1:] and y.dtype == np.float32
    assert relative_error(y, case.reference()[0]) < 1e-4
    g = p.backward(np.ones_like(y), **arrays)
    assert g.input.shape == arrays["input"].shape and g.offset.shape == arrays["offset"].shape


def _conv_plan():
    x = np.zeros((2, 4, 8, 8))
    w = np.zeros((6, 2, 3, 3))
    off = np.zeros((2, 18, 6, 6))
    return dcn_cupy.plan(x, w, off, None, np.zeros(6), groups=2), x, w, off


@pytest.mark.parametrize("call, message", [
    (lambda x, w, o: dict(input=x[:1], weight=w, offset=o[:1], bias=np.zeros(6)),
     r"input must have the plan's shape \(2, 4, 8, 8\), got \(1, 4, 8, 8\)"),
    (lambda x, w, o: dict(input=x, weight=w.astype(np.float32), offset=o, bias=np.zeros(6)),
     "weight must have the plan's dtype float64, got float32"),
    (lambda x, w, o: dict(input=x, weight=w, offset=None, bias=np.zeros(6)),
     r"offset is missing: this plan was built with a offset of shape \(2, 18, 6, 6\)"),
    (lambda x, w, o: dict(input=x, weight=w, offset=o, mask=np.zeros((2, 9, 6, 6)), bias=np.zeros(6)),
     "mask must be None: this plan was built without mask"),
    (lambda x, w, o: dict(input=x, weight=w, offset=o, bias=np.zeros(5)),
     r"bias must have the plan's shape \(6,\), got \(5,\)"),
])
def test_forward_mismatch_names_the_argument(call, message):
    p, x, w, off = _conv_plan()
    with pytest.raises(ValueError, match=message):
        p.forward(**call(x, w, off))


def test_backward_mismatch_and_library_mix():
    p, x, w, off = _conv_plan()
    with pytest.raises(ValueError, match=r"grad_output must have the plan's shape \(2, 6, 6, 6\), got \(2, 6, 6, 5\)"):
        p.backward(np.zeros((2, 6, 6, 5)), x, w, off, None, np.zeros(6))
    with pytest.raises(ValueError, match=r"input is required for the gradients \['offset', 'weight'\], got None"):
        p.backward(np.zeros((2, 6, 6, 6)), None, w, off, None, np.zeros(6), wrt=("weight", "offset"))
    g = p.backward(np.ones((2, 6, 6, 6)), None, w, off, None, np.zeros(6), wrt=("input", "bias"))
    assert g.input.shape == x.shape and np.all(g.bias == 72)
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"weight must come from the same library as input \(numpy\), got torch"):
        p.forward(x, torch.from_numpy(w), off, None, np.zeros(6))


def test_out_receives_the_result():
    rng = np.random.default_rng(5)
    case = random_case(rng, 2, True)
    arrays = case.arrays()
    p = _plan_of(case)
    out = np.full(p.output_shape, np.nan)
    assert p.forward(**arrays, out=out) is out
    assert relative_error(out, case.reference()) < 1e-10
    with pytest.raises(ValueError, match=r"out must be a C-contiguous array of shape .* got shape"):
        p.forward(**arrays, out=np.empty(p.output_shape[:-1] + (p.output_shape[-1] + 1,)))
    with pytest.raises(ValueError, match="out must be C-contiguous"):
        p.forward(**arrays, out=np.empty(p.output_shape[::-1]).T)
    gy = rng.standard_normal(p.output_shape)
    expected = p.backward(gy, **arrays)
    grad_w = np.empty_like(arrays["weight"])
    grad_b = np.empty_like(arrays["bias"])
    got = p.backward(gy, **arrays, out={"weight": grad_w, "bias": grad_b})
    assert got.weight is grad_w and got.bias is grad_b
    np.testing.assert_array_equal(grad_w, expected.weight)
    np.testing.assert_allclose(grad_b, expected.bias)
    np.testing.assert_array_equal(got.offset, expected.offset)
    with pytest.raises(ValueError, match=r"out\['weight'\] given for a gradient that is not computed"):
        p.backward(gy, **arrays, wrt="input", out={"weight": grad_w})


class _CountingBackend:
    """cpu/counting: the Numba backend behind a workspace that must be passed to run()."""

    device, algorithm, priority = "cpu", "counting", -1

    def __init__(self, sizes=None):
        self.calls = []
        self.numba = _backends.backend_named("cpu/numba")
        self.sizes = sizes or {}   # primitive -> workspace bytes (96 where not given)

    def serves(self, spec, primitive):
        return None if spec.dtype == np.float64 else "float64 only"

    def build(self, spec, primitive):
        inner = self.numba.build(spec, primitive)
        backend = self

        size = self.sizes.get(primitive, 96)

        class Executable:
            workspace_bytes = size
            description = f"cpu/counting: numba with a {size}-byte workspace"

            def run(self, args, out, workspace):
                assert workspace.dtype == np.uint8 and workspace.ndim == 1 and workspace.nbytes >= size
                backend.calls.append((primitive, workspace.nbytes))
                inner.run(args, out, workspace)

        return Executable()


@pytest.fixture
def counting():
    backend = _CountingBackend()
    _backends.register(backend)
    _plan.clear_plan_cache()
    yield backend
    _backends.unregister("cpu/counting")
    _plan.clear_plan_cache()


def test_workspace_and_forcing(counting):
    rng = np.random.default_rng(6)
    case = random_case(rng, 2, False)
    arrays = case.arrays()
    p = _plan_of(case, algorithm="cpu/counting")
    assert p.workspace_bytes == 96 and p.algorithm == "forward: cpu/counting, backward: cpu/counting"
    text = str(p)
    assert "forced: cpu/counting" in text and "96-byte workspace" in text and "workspace: 96 bytes" in text
    p.forward(**arrays)
    p.forward(**arrays, workspace=np.empty(12, np.float64))
    assert counting.calls == [("conv_forward", 96), ("conv_forward", 96)]
    with pytest.raises(ValueError,
                       match=r"workspace must hold at least 96 bytes \(plan.forward_workspace_bytes\), got 88"):
        p.forward(**arrays, workspace=np.empty(11, np.float64))
    # automatic choice: the higher priority numba backend
    assert "cpu/counting" not in _plan_of(case).algorithm
    # use_algorithm reaches the functional API (part of its cache key)
    with use_algorithm("cpu/counting"):
        y = case.forward(**arrays, **case.params)
    assert counting.calls[-1][0] == "conv_forward"
    np.testing.assert_array_equal(y, p.forward(**arrays))
    calls = len(counting.calls)
    case.forward(**arrays, **case.params)
    assert len(counting.calls) == calls  # not forced any more
    with pytest.raises(ValueError, match="algorithm 'cpu/counting' does not serve this conv_forward: float64 only"):
        _plan_of(case, arrays=case.arrays(lambda a: a.astype(np.float32)), algorithm="cpu/counting")


@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transpose"])
def test_each_call_allocates_and_checks_its_own_workspace(transposed):
    # forward 96 bytes, backward 160: a forward allocates 96 and takes a 96-byte buffer; the
    # backward needs 160 (for the transposed operation the primitives swap roles)
    backend = _CountingBackend({"conv_forward": 96, "conv_backward": 160})
    _backends.register(backend)
    _plan.clear_plan_cache()
    try:
        rng = np.random.default_rng(8)
        case = random_case(rng, 2, transposed)
        arrays = case.arrays()
        p = _plan_of(case, algorithm="cpu/counting")
        fwd, bwd = (160, 160) if transposed else (96, 160)
        assert (p.forward_workspace_bytes, p.backward_workspace_bytes, p.workspace_bytes) == (fwd, bwd, 160)
        y = p.forward(**arrays)
        assert backend.calls[-1][1] == fwd    # allocated: the forward's own size
        p.forward(**arrays, workspace=np.empty(fwd, np.uint8))
        gy = np.ones_like(y)
        before = len(backend.calls)
        p.backward(gy, **arrays)
        assert backend.calls[before:] and {n for _, n in backend.calls[before:]} == {bwd}
        with pytest.raises(ValueError, match=rf"workspace must hold at least {bwd} bytes "
                                              rf"\(plan.backward_workspace_bytes\), got 96"):
            p.backward(gy, **arrays, workspace=np.empty(96, np.uint8))
        p.backward(gy, **arrays, workspace=np.empty(p.workspace_bytes, np.uint8))
    finally:
        _backends.unregister("cpu/counting")
        _plan.clear_plan_cache()


def test_forcing_errors():
    p, x, w, off = _conv_plan()
    with pytest.raises(ValueError, match=r"algorithm must be one of \[.*'cpu/numba'.*\], got 'cpu/nothing'"):
        dcn_cupy.plan(x, w, algorithm="cpu/nothing", groups=2)
    with pytest.raises(ValueError, match="algorithm 'cuda/im2col' runs on cuda arrays, got arrays on cpu"):
        dcn_cupy.plan(x, w, algorithm="cuda/im2col", groups=2)
    with pytest.raises(ValueError, match="algorithm must be one of"):
        with use_algorithm("gpu/none"):
            pass


def test_str_says_what_was_chosen_and_why():
    p, *_ = _conv_plan()
    text = str(p)
    assert "deform_conv2d on cpu, float64" in text and "input=(2, 4, 8, 8)" in text and "-> (2, 6, 6, 6)" in text
    assert "forward: cpu/numba, backward: cpu/numba" in text and "automatic" in text
    assert "conv_forward (forward): cpu/numba" in text
    assert p.workspace_bytes == 0


def test_empty_batch():
    p = dcn_cupy.plan(np.zeros((0, 2, 5)), np.ones((3, 2, 3)), bias=np.ones(3))
    assert p.forward(np.zeros((0, 2, 5)), np.ones((3, 2, 3)), bias=np.ones(3)).shape == (0, 3, 3)
    g = p.backward(np.zeros((0, 3, 3)), np.zeros((0, 2, 5)), np.ones((3, 2, 3)), bias=np.ones(3))
    assert g.input.shape == (0, 2, 5) and np.all(g.weight == 0) and np.all(g.bias == 0)
    assert "empty batch" in p.algorithm


def test_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(_plan, "PLAN_CACHE_SIZE", 3)
    _plan.clear_plan_cache()
    w = np.ones((2, 1, 3))
    for length in range(5, 12):
        dcn_cupy.deform_conv1d(np.ones((1, 1, length)), w)
    assert _plan.plan_cache_size() == 3
    dcn_cupy.deform_conv1d(np.ones((1, 1, 11)), w)  # a hit keeps the size
    assert _plan.plan_cache_size() == 3


def test_concurrent_first_use_from_threads():
    rng = np.random.default_rng(9)
    case = random_case(rng, 2, True, batch=2)
    arrays = case.arrays()
    expected = case.reference()
    _plan.clear_plan_cache()
    results, errors = [None] * 8, []
    barrier = threading.Barrier(8)

    def work(i):
        try:
            barrier.wait()
            results[i] = case.forward(**arrays, **case.params)
        except Exception as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for y in results:
        np.testing.assert_array_equal(y, results[0])
    assert relative_error(results[0], expected) < 1e-10
    assert _plan.plan_cache_size() == 1


def test_functional_hyper_parameters_are_validated_before_the_cache():
    x, w = np.zeros((1, 2, 6, 6)), np.zeros((2, 2, 3, 3))
    dcn_cupy.deform_conv2d(x, w, stride=1)
    with pytest.raises(TypeError, match="stride must be an int, got bool"):
        dcn_cupy.deform_conv2d(x, w, stride=True)
    assert dcn_cupy.deform_conv2d(x, w, stride=[1, 2]).shape == (1, 2, 4, 2)
    assert dcn_cupy.deform_conv2d(x, w, stride=np.int64(2)).shape == (1, 2, 2, 2)


# ---------------------------------------------------------------------------------------------
# GPU: capture of plan.forward / plan.backward in a CUDA graph through CuPy's stream capture


@pytest.mark.gpu
@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transpose"])
def test_plan_cupy_stream_capture(transposed):
    cupy = pytest.importorskip("cupy")
    rng = np.random.default_rng(20 + transposed)
    case = random_case(rng, 2, transposed, batch=3)
    a = case.arrays(lambda v: cupy.asarray(v.astype(np.float32)))
    p = _plan_of(case, arrays=a)
    gy = cupy.asarray(rng.standard_normal(p.output_shape).astype(np.float32))
    eager_y = p.forward(**a)
    eager_g = p.backward(gy, **a)
    out = cupy.empty(p.output_shape, np.float32)
    grads = {n: cupy.empty_like(v) for n, v in a.items() if v is not None}
    workspace = cupy.empty(max(p.workspace_bytes, 1), np.uint8)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        p.forward(**a, out=out, workspace=workspace)          # warm-up: the pool holds what a call takes
        p.backward(gy, **a, out=grads, workspace=workspace)
        stream.synchronize()
        out.fill(0)
        for g in grads.values():
            g.fill(0)
        stream.begin_capture()
        p.forward(**a, out=out, workspace=workspace)
        p.backward(gy, **a, out=grads, workspace=workspace)
        graph = stream.end_capture()
        graph.launch()
        stream.synchronize()
    assert relative_error(cupy.asnumpy(out), cupy.asnumpy(eager_y)) < 1e-6
    for name, g in grads.items():
        assert relative_error(cupy.asnumpy(g), cupy.asnumpy(getattr(eager_g, name))) < 1e-5, name
    out.fill(0)
    graph.launch(stream)
    stream.synchronize()
    assert relative_error(cupy.asnumpy(out), cupy.asnumpy(eager_y)) < 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomics", "deterministic"])
@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_transposed_backward_replays_its_parts_as_one_list(ndim, deterministic, monkeypatch):
    """The transposed backward's parts (the convolution forward to the input, the parameter
    gradients, the bias gradient) recorded as one list and replayed, from the second replay on as
    one CUDA graph: the gradients of the parts run as their own lists, for each ``wrt``, on a
    poisoned workspace; bitwise the same in deterministic mode, the reference's in both modes.
    Beside the input gradient, the bias gradient comes from the sums the convolution forward
    takes as it copies grad_output (no channel_sum launch)."""
    cupy = pytest.importorskip("cupy")
    from dcn_cupy._backends import cuda_direct, cuda_fused
    monkeypatch.setattr(cuda_direct, "MAX_MACS", 0)
    monkeypatch.setattr(cuda_fused, "TUNE", False)   # the rule: the fused kernels, their own weight gradient
    rng = np.random.default_rng(60 + ndim)
    case = random_case(rng, ndim, True, batch=3, channels_scale=8)
    dtype = np.dtype(np.float16)
    host = case.arrays(lambda v: v.astype(dtype).astype(np.float64))
    dev = {k: None if v is None else cupy.asarray(v.astype(dtype)) for k, v in host.items()}
    p = _plan_of(case, arrays=dev, deterministic=deterministic)
    assert p._chain is not None, p.algorithm
    assert p._folds_bias(frozenset(("input", "bias"))) and not p._folds_bias(frozenset(("weight", "bias")))
    gy64 = rng.standard_normal(p.output_shape).astype(dtype).astype(np.float64)
    gy = cupy.asarray(gy64.astype(dtype))
    expected = case.backward(gy64, **host, **case.params)
    out = {name: cupy.empty_like(a) for name, a in dev.items() if a is not None}
    workspace = cupy.empty(max(p.workspace_bytes, 1), np.uint8)
    weight_part = p._bwd[1]._weight   # cuda/im2col's weight gradient, where the fused one is not
    for wrt in (None, ("input",), ("weight", "bias"), ("offset", "mask"), ("input", "mask", "bias")):
        names = [n for n in ARGUMENTS if n in out and (wrt is None or n in wrt)]
        for recordings in (p._bwd_input[1]._recordings, p._bwd[1]._recordings, p._bias_sum_pointers._recordings) + (
                (weight_part._recordings,) if weight_part is not None else ()):
            recordings.entries.clear()   # (so that the last entry is this wrt's, not an earlier one's)
        runs = []
        for chained in (False, False, True, True, True):   # a list's second replay on: its CUDA graph
            monkeypatch.setattr(_plan, "CHAIN_TRANSPOSED_BACKWARD", chained)
            workspace.fill(0xFF)
            for name in names:
                out[name].fill(np.nan)
            p.backward(gy, **dev, wrt=wrt, out={n: out[n] for n in names}, workspace=workspace)
            runs.append({n: cupy.asnumpy(out[n]) for n in names})
        # one list unless cuda/im2col computes the weight gradient with a channels-last copy of
        # its own: then the parts' own
        recorded = list(p._chain.entries.values())[-1]
        own = p._bwd[1].config.fused_weight or bool(p._bwd[1]._weight_at)
        assert bool(recorded) == ("weight" not in names or own), (wrt, p.algorithm)
        if recorded and "input" in names and {"weight", "offset", "mask"} & set(names):
            # the parts' own lists, as the unchained runs recorded them; chained, grad_output's
            # channels-last copy is made once where each part takes the batch in one chunk
            lists = [list(e._recordings.entries.values())[-1] for e in (p._bwd_input[1], p._bwd[1])]
            if "bias" in names and not p._folds_bias(frozenset(names)):
                lists.append(list(p._bias_sum_pointers._recordings.entries.values())[-1])
            # the weight gradient through cuda/im2col on the fused copy (3D float16 here): its own
            # list, and in the chain the handle op its GEMMs follow
            through = "weight" in names and weight_part is not None
            if through:
                lists.append(list(weight_part._recordings.entries.values())[-1])
            once = p._bwd_input[1].channels_last_input() is not None and p._bwd[1].config.chunk >= 3
            assert len(recorded) == sum(len(ops) for ops in lists) - once + through, wrt
        for grads in runs:
            for name in names:
                assert relative_error(grads[name], getattr(expected, name)) < 2e-2, (wrt, name)
        if deterministic:
            for grads in runs[1:]:
                for name in names:
                    np.testing.assert_array_equal(grads[name], runs[0][name], err_msg=f"{wrt} {name}")


def test_the_transposed_chain_takes_only_executables_made_for_it():
    """A transposed plan chains its backward's parts into one list where each executable has a
    ``record`` (``_plan``'s test): the fused forward (the input gradient) and the fused backward
    (the parameter gradients, given the input's channels-last copy as ``input_channels_last``).
    cuda/im2col's executables, and cuda/im2col-deterministic's backward, have none: their
    launches run as their own lists. (Session 48 gave cuda/im2col's backward a ``record`` for the
    fused backward's weight gradient; transposed plans whose parameter gradients took cuda/im2col
    then called it with the fused backward's keyword and failed.) No GPU needed."""
    pytest.importorskip("cupy")
    import inspect
    from dcn_cupy._backends import cuda, cuda_deterministic, cuda_direct, cuda_fused, cuda_fused_backward
    for cls in (cuda._Forward, cuda._Backward, cuda_deterministic._DeterministicBackward, cuda_direct._Forward):
        assert not callable(getattr(cls, "record", None)), cls
    assert callable(cuda._Backward.record_led_by_handle)
    assert callable(cuda_fused.FusedForward.record)
    assert "input_channels_last" in inspect.signature(cuda_fused_backward.FusedBackward.record).parameters


@pytest.mark.gpu
@pytest.mark.parametrize("ndim", [2, 3])
def test_transposed_backward_weight_gradient_through_im2col_shares_the_copy(ndim, monkeypatch):
    """Where the fused backward leaves the weight gradient to cuda/im2col, that samples its
    columns from the fused backward's channels-last copy of x (``SHARED_COPY``: in the chain, the
    one the input gradient's forward made), on the workspace past that copy, and its GEMMs join
    the chain's list, a CUDA graph from its second replay, with one copy of x where the parts'
    own lists made one each. For each ``wrt``, on a poisoned workspace, chained or not: the
    weight gradient bitwise that of cuda/im2col with its own copy, every gradient the
    reference's. (float16: its plans take the fused forward for the input gradient, which the
    chain needs; 3D's columns come from the channels-last sampler too.)"""
    cupy = pytest.importorskip("cupy")
    from dcn_cupy._backends import cuda_direct, cuda_fused
    from dcn_cupy._backends import cuda_fused_backward as fb
    monkeypatch.setattr(cuda_direct, "MAX_MACS", 0)
    monkeypatch.setattr(cuda_fused, "TUNE", False)
    monkeypatch.setattr(fb, "fused_weight_choice", lambda *args, **kwargs: False)
    rng = np.random.default_rng(70 + ndim)
    case = random_case(rng, ndim, True, batch=3, channels_scale=8, bias=False)
    dtype = np.dtype(np.float16)
    host = case.arrays(lambda v: v.astype(dtype).astype(np.float64))
    dev = {k: None if v is None else cupy.asarray(v.astype(dtype)) for k, v in host.items()}
    gy64 = rng.standard_normal(_plan_of(case, arrays=dev).output_shape).astype(dtype).astype(np.float64)
    gy = cupy.asarray(gy64.astype(dtype))
    expected = case.backward(gy64, **host, **case.params)
    out = {name: cupy.empty_like(a) for name, a in dev.items() if a is not None}
    wrts = (("input", "weight", "offset", "mask"), ("weight",), ("weight", "offset"), ("input", "weight"))
    weights, own_lists = {}, {}
    kernels = lambda ops: sum(1 for op in ops if op[0] == 0)   # noqa: E731
    for shared in (False, True):
        monkeypatch.setattr(fb, "SHARED_COPY", shared)
        p = _plan_of(case, arrays=dev, allow_tf32=False)
        exe = p._bwd[1]
        assert p._chain is not None and not exe.config.fused_weight, p.algorithm
        assert bool(exe._weight_at) == shared and exe._weight.copy_given == shared, str(p)
        assert ("its columns from the channels-last copy of the input" in str(p)) == shared
        workspace = cupy.empty(max(p.workspace_bytes, 1), np.uint8)
        parts = (p._bwd_input[1], exe, exe._weight)
        for wrt in wrts:
            for e in parts:
                e._recordings.entries.clear()
            for chained in (False, True, True, True):   # the chained list's second replay on: its graph
                monkeypatch.setattr(_plan, "CHAIN_TRANSPOSED_BACKWARD", chained)
                workspace.fill(0xFF)
                for name in wrt:
                    out[name].fill(np.nan)
                p.backward(gy, **dev, wrt=wrt, out={n: out[n] for n in wrt}, workspace=workspace)
                for name in wrt:
                    got = cupy.asnumpy(out[name]).astype(np.float64)
                    assert relative_error(got, getattr(expected, name)) < 2e-2, (shared, wrt, chained, name)
                weights.setdefault(wrt, []).append(cupy.asnumpy(out["weight"]))
            recorded = list(p._chain.entries.values())[-1]
            assert bool(recorded) == shared, wrt
            if not shared:   # the parts' own lists, each with its copy of x
                own_lists[wrt] = sum(kernels(list(e._recordings.entries.values())[-1]) for e in parts
                                     if e._recordings.entries)
            else:
                assert any(op[0] == 1 for op in recorded) and recorded.graph, wrt   # its GEMMs, in its graph
                # one copy of x, where the parts made one each: the input gradient's forward, the
                # offset and mask gradients' and the weight gradient's
                saved = ("input" in wrt) + bool({"offset", "mask"} & set(wrt))
                assert kernels(recorded) == own_lists[wrt] - saved, wrt
    for wrt, runs in weights.items():
        for got in runs[1:]:
            np.testing.assert_array_equal(got, runs[0], err_msg=str(wrt))


@pytest.mark.gpu
def test_plan_on_cupy_matches_cpu_and_str(monkeypatch):
    cupy = pytest.importorskip("cupy")
    from dcn_cupy._backends import cuda_direct
    monkeypatch.setattr(cuda_direct, "MAX_MACS", 0)   # the choice among the other CUDA algorithms
    rng = np.random.default_rng(31)
    case = random_case(rng, 3, False, batch=2)
    p = _plan_of(case, arrays=case.arrays(cupy.asarray))
    assert p.algorithm.startswith("forward: cuda/im2col") and "cuda/im2col forward: 1 chunk(s)" in str(p)
    y = p.forward(**case.arrays(cupy.asarray))
    assert relative_error(cupy.asnumpy(y), case.reference()) < 1e-10


class _NoBackwardBackend:
    """cpu/nobackward: numba's forward; its backward needs more memory than there is."""

    device, algorithm, priority = "cpu", "nobackward", -1

    def __init__(self):
        self.numba = _backends.backend_named("cpu/numba")

    def serves(self, spec, primitive):
        return None

    def build(self, spec, primitive):
        if primitive == "conv_backward":
            raise MemoryError("needs a workspace of at least 10**12 bytes, more than the limit")
        return self.numba.build(spec, primitive)


def test_a_backward_that_cannot_fit_is_refused_when_called():
    _backends.register(_NoBackwardBackend())
    try:
        rng = np.random.default_rng(12)
        case = random_case(rng, 1, False)
        arrays = case.arrays()
        p = _plan_of(case, algorithm="cpu/nobackward")
        assert relative_error(p.forward(**arrays), case.reference()) < 1e-10
        assert "backward: none (needs a workspace" in p.algorithm and "unavailable" in str(p)
        with pytest.raises(MemoryError, match="needs a workspace of at least"):
            p.backward(np.ones(p.output_shape), **arrays)
        g = p.backward(np.ones(p.output_shape), **arrays, wrt="bias")  # no executable needed
        assert g.bias is not None
        # transposed: the forward is conv_backward, so the plan itself is refused
        tcase = random_case(rng, 1, True)
        with pytest.raises(MemoryError, match="needs a workspace of at least"):
            _plan_of(tcase, algorithm="cpu/nobackward")
    finally:
        _backends.unregister("cpu/nobackward")


def test_cuda_chunking_rules():
    """Whole samples while one fits the limit, else slabs of output rows; else a MemoryError."""
    cuda = pytest.importorskip("dcn_cupy._backends.cuda")
    from dcn_cupy import _geometry
    geom, _ = _geometry.conv_geometry((4, 3, 9, 7), (5, 3, 3, 3), None, None, None, 1, 1, 1, 1)  # Q = 9x7
    per_position = 100
    assert cuda._plan_chunks(geom, per_position, 0, 0, 10**9, "forward") == (4, None)
    assert cuda._plan_chunks(geom, per_position, 1000, 0, 1000 + 2 * 6300, "forward") == (2, None)
    assert cuda._plan_chunks(geom, per_position, 0, 0, 6299, "forward") == (1, 8)   # 8 rows of 7 positions
    assert cuda._plan_chunks(geom, per_position, 0, 0, 700, "forward") == (1, 1)
    with pytest.raises(MemoryError, match=r"needs a workspace of at least 800 bytes .* limit of 799 bytes"):
        cuda._plan_chunks(geom, per_position, 100, 0, 799, "forward")
    sub = cuda._sub_geometry(geom, 1, 3, 6)
    assert sub.output_shape == (3, 7) and sub.padding == (1 - 3, 1)


def test_weight_gemm_splits_rule():
    """The weight gradient's GEMM is split along the positions only where its output's 64x64
    tiles leave multiprocessors idle, each split at least 512 positions deep, at most
    GEMM_SPLITS, never with several conv groups, nor in strict float32 over many positions."""
    cuda = pytest.importorskip("dcn_cupy._backends.cuda")
    assert cuda.gemm_splits(1, 32, 864, 8192, 132) == 8        # 3D transposed C32: 14 tiles
    assert cuda.gemm_splits(1, 32, 864, 8192, 132, most=16) == 9
    assert cuda.gemm_splits(1, 32, 864, 2048, 132) == 4         # depth bounds it
    assert cuda.gemm_splits(1, 256, 768, 65536, 132) == 2       # 1D C256: 48 tiles
    assert cuda.gemm_splits(1, 256, 2304, 25088, 132) == 1      # C256 56x56: 144 tiles fill the device
    assert cuda.gemm_splits(1, 32, 864, 1000, 132) == 1         # too shallow to split
    assert cuda.gemm_splits(2, 16, 432, 8192, 132) == 1         # conv groups: their batch
    assert cuda.gemm_splits(1, 32, 864, 8192, 0) == 1           # no device
    # strict float32: not over more than _GEMM_STRICT_DEPTH positions (3D C32 32^3: 65536)
    assert cuda.gemm_splits(1, 32, 864, 8192, 132, strict=True) == 8
    assert cuda.gemm_splits(1, 32, 864, 65536, 132, strict=True) == 1
    assert cuda.gemm_splits(1, 32, 864, 65536, 132) == 8


@pytest.mark.gpu
def test_concurrent_first_use_on_the_gpu():
    """Threads racing to build (and compile) the same plan agree, and match one serial call."""
    cupy = pytest.importorskip("cupy")
    rng = np.random.default_rng(41)
    case = random_case(rng, 3, False, batch=2)
    arrays = case.arrays(lambda v: cupy.asarray(v.astype(np.float32)))
    _plan.clear_plan_cache()
    results, errors = [None] * 6, []
    barrier = threading.Barrier(6)

    def work(i):
        try:
            barrier.wait()
            y = case.forward(**arrays, **case.params)
            cupy.cuda.get_current_stream().synchronize()
            results[i] = cupy.asnumpy(y)
        except Exception as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for y in results:
        np.testing.assert_array_equal(y, results[0])
    assert relative_error(results[0], case.reference()) < 1e-5


def test_cuda_graphs_step_aside_where_the_driver_has_none(monkeypatch):
    """Recorded lists of at least GRAPH_MIN_LAUNCHES kernels (and memsets) are CUDA-graph
    candidates, and so are those whose GEMMs follow a handle op (which points the handle at the
    capture stream); lists with a GEMM on the caller's handle or fewer kernels are not, and a
    driver library without the graph functions leaves every list replayed launch by launch."""
    pytest.importorskip("cupy")
    from dcn_cupy._backends import cuda

    kernel, gemm, handle = (0, 1, 1, 32, 0, 0, None, None), (1, None, None, None, None), cuda.handle_op(0, 256, 1024)
    assert handle == (3, 0, 256, 1024)
    assert cuda.Recordings().put((1,), [kernel] * 3).graph is None
    assert cuda.Recordings().put((1,), [kernel] * 2).graph is False
    assert cuda.Recordings().put((1,), [kernel] * 3 + [gemm]).graph is False
    assert cuda.Recordings().put((1,), [kernel] * 3 + [handle, gemm]).graph is None
    assert cuda.Recordings().put((1,), [kernel, gemm, handle, kernel, kernel, gemm]).graph is False
    assert cuda.Recordings().put((1,), [handle, kernel, gemm] * 2 + [kernel]).graph is None
    monkeypatch.setattr(cuda, "GRAPHS", False)
    assert cuda.Recordings().put((1,), [kernel] * 3).graph is False
    monkeypatch.setattr(cuda, "GRAPHS", True)
    monkeypatch.setattr(cuda, "_launch_function", lambda: None)
    monkeypatch.setattr(cuda, "_graph_library", object())   # no cuStreamBeginCapture_v2 & co
    monkeypatch.setattr(cuda, "_graphs", None)
    ops = cuda.Recordings().put((1,), [kernel] * 3)
    assert cuda._replay_graph(ops, 0) is False and ops.graph is False and cuda._graphs is False


def test_cuda_recordings_keep_the_last_few_address_sets():
    """The CUDA executables replay launches recorded per set of addresses: a caller alternating
    between buffer sets (XLA, a caching allocator) must hit, and the cache stays bounded."""
    pytest.importorskip("cupy")
    from dcn_cupy._backends.cuda import Recordings

    r = Recordings()
    assert r.get((1, 2)) is None
    assert r.put((1, 2), "a") == "a" and r.put((3, 4), "b") == "b"
    assert r.get((1, 2)) == "a" and r.get((3, 4)) == "b"   # alternating sets both hit
    for i in range(Recordings.SIZE):
        r.put((10, i), i)
    assert len(r.entries) == Recordings.SIZE
    assert r.get((1, 2)) is None and r.get((3, 4)) is None   # the oldest went first
    assert r.get((10, Recordings.SIZE - 1)) == Recordings.SIZE - 1
