"""Arrays from NumPy, PyTorch and JAX come back in their own library, dtype and shape."""

import numpy as np
import pytest

import dcn_cupy
from dcn_cupy._interop import BFLOAT16, to_native

from child_process import run_python
from dcn_cupy.testing import ARGUMENTS, random_case, relative_error


def _torch_case(dtype_name):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    case = random_case(rng, 2, False)
    dtype = getattr(torch, dtype_name)
    return torch, case, case.arrays(lambda a: torch.from_numpy(a).to(dtype))


@pytest.mark.parametrize("dtype_name", ["float64", "float32", "float16", "bfloat16"])
def test_torch_cpu_tensors_round_trip(dtype_name):
    torch, case, tensors = _torch_case(dtype_name)
    out = case.forward(**tensors, **case.params)
    assert isinstance(out, torch.Tensor) and out.dtype == getattr(torch, dtype_name) and out.device.type == "cpu"
    tol = {"float64": 1e-10, "float32": 1e-4, "float16": 5e-3, "bfloat16": 3e-2}[dtype_name]
    assert relative_error(out.double().numpy(), case.reference()) < tol
    grads = case.backward(torch.ones_like(out), **tensors, **case.params)
    for name in ARGUMENTS:
        g = getattr(grads, name)
        assert isinstance(g, torch.Tensor) and g.dtype == out.dtype and g.shape == tensors[name].shape


def test_torch_zero_copy_import():
    torch = pytest.importorskip("torch")
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    native, origin = to_native(t, "input")
    assert isinstance(native, np.ndarray) and origin.library == "torch"
    assert native.ctypes.data == t.data_ptr()
    b = torch.arange(4, dtype=torch.bfloat16)
    native, origin = to_native(b, "input")
    assert native.dtype == BFLOAT16 and native.ctypes.data == b.data_ptr()


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_jax_cpu_arrays_round_trip(dtype_name):
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    rng = np.random.default_rng(2)
    case = random_case(rng, 1, True)
    dtype = getattr(jnp, dtype_name)
    arrays = case.arrays(lambda a: jnp.asarray(a, dtype=dtype))
    out = case.forward(**arrays, **case.params)
    assert isinstance(out, jax.Array) and out.dtype == dtype
    tol = 1e-4 if dtype_name == "float32" else 3e-2
    assert relative_error(np.asarray(out, dtype=np.float64), case.reference()) < tol
    grads = case.backward(jnp.ones_like(out), **arrays, **case.params)
    assert all(isinstance(getattr(grads, n), jax.Array) and getattr(grads, n).shape == arrays[n].shape
               for n in ARGUMENTS)
    y = dcn_cupy.mask_sigmoid(arrays["mask"])
    assert isinstance(y, jax.Array) and y.dtype == dtype


def test_mask_activations_keep_library():
    torch = pytest.importorskip("torch")
    m = torch.randn(2, 18, 3, 3, dtype=torch.float64)
    y = dcn_cupy.mask_softmax2d(m, 3)
    assert isinstance(y, torch.Tensor)
    torch.testing.assert_close(y.view(2, 2, 9, 3, 3).sum(2), torch.ones(2, 2, 3, 3, dtype=torch.float64))
    g = dcn_cupy.mask_softmax_backward(torch.randn_like(y), y, 3)
    assert isinstance(g, torch.Tensor) and g.shape == m.shape


def test_torch_lazy_negation_is_honoured():
    torch = pytest.importorskip("torch")
    m = torch.randn(2, 9, 3, 3, dtype=torch.float64)
    negated = torch._neg_view(m)
    torch.testing.assert_close(dcn_cupy.mask_sigmoid(negated, 1.0), torch.sigmoid(-m))


# ---------------------------------------------------------------------------------------------
# arrays the core refuses, with the argument's name; raw DLPack capsules


def test_none_where_an_array_is_required():
    w = np.zeros((2, 2, 3))
    with pytest.raises(TypeError, match="input must be an array, got None"):
        dcn_cupy.deform_conv1d(None, w)
    with pytest.raises(TypeError, match="weight must be an array, got None"):
        dcn_cupy.deform_conv1d(np.zeros((1, 2, 5)), None)
    with pytest.raises(TypeError, match="grad_output must be an array, got None"):
        dcn_cupy.deform_conv1d_backward(None, np.zeros((1, 2, 5)), w)
    with pytest.raises(TypeError, match="mask must be an array, got None"):
        dcn_cupy.mask_sigmoid(None)
    with pytest.raises(TypeError, match="input must be an array or a shape/dtype spec, got None"):
        dcn_cupy.plan(None, w)


def test_big_endian_arrays_are_refused_with_the_byte_order():
    x = np.zeros((1, 2, 5), dtype=">f8")
    with pytest.raises(TypeError, match=r"input must be a native-byte-order array .* got the big-endian dtype '>f8'"):
        dcn_cupy.deform_conv1d(x, np.zeros((2, 2, 3)))
    with pytest.raises(TypeError, match=r"weight must be a native-byte-order array .* with weight.astype\('float64'\)"):
        dcn_cupy.deform_conv1d(np.zeros((1, 2, 5)), np.zeros((2, 2, 3), dtype=">f8"))


def test_masked_arrays_are_refused_with_the_reason():
    x = np.ma.masked_array(np.zeros((1, 2, 5)), mask=np.zeros((1, 2, 5), bool))
    with pytest.raises(TypeError, match=r"input is a numpy.ma.MaskedArray; dcn_cupy would ignore its mask"):
        dcn_cupy.deform_conv1d(x, np.zeros((2, 2, 3)))


def test_torch_meta_tensors_are_refused():
    torch = pytest.importorskip("torch")
    x = torch.zeros(1, 2, 5, device="meta", dtype=torch.float64)
    with pytest.raises(TypeError, match="input is a torch meta tensor, which has no data"):
        dcn_cupy.deform_conv1d(x, torch.zeros(2, 2, 3, dtype=torch.float64))
    # as a spec, a meta tensor plans a configuration
    p = dcn_cupy.plan(x, torch.zeros(2, 2, 3, dtype=torch.float64, device="meta"))
    assert p.output_shape == (1, 2, 3) and p.device == "cpu"


def test_raw_dlpack_capsules():
    rng = np.random.default_rng(3)
    case = random_case(rng, 1, False, mask=False, bias=False)
    arrays = case.arrays()
    capsules = {k: None if a is None else a.__dlpack__() for k, a in arrays.items()}
    y = case.forward(**capsules, **case.params)
    assert isinstance(y, np.ndarray) and relative_error(y, case.reference()) < 1e-12
    torch = pytest.importorskip("torch")
    mixed = {k: None if a is None else a.__dlpack__() for k, a in arrays.items()}
    mixed["input"] = torch.from_numpy(arrays["input"])
    y = case.forward(**mixed, **case.params)
    assert isinstance(y, torch.Tensor)  # another argument names the library


def test_registering_a_library():
    from dcn_cupy import _interop

    class Boxed:
        def __init__(self, array):
            self.array = array

    class BoxLibrary:
        name = "box"

        def owns(self, array):
            return isinstance(array, Boxed)

        def to_native(self, array, name):
            return array.array, "cpu", 0

        def from_native(self, native, origin):
            return Boxed(native)

    library = BoxLibrary()
    _interop.register_library(library)
    try:
        y = dcn_cupy.deform_conv1d(Boxed(np.ones((1, 1, 4))), Boxed(np.ones((1, 1, 2))))
        assert isinstance(y, Boxed) and np.all(y.array == 2)
    finally:
        _interop._libraries.remove(library)
        _interop._by_type.clear()
        _interop._by_type[np.ndarray] = _interop._NUMPY


def test_ml_dtypes_is_imported_only_for_bfloat16():
    """``import dcn_cupy`` and calls in other dtypes leave ml_dtypes (0.6-0.8 s to import)
    unimported; the first bfloat16 array brings it, and bfloat16 then takes the fast path."""
    out = run_python("""
        import sys, numpy as np, dcn_cupy
        from dcn_cupy import _interop
        y = dcn_cupy.deform_conv1d(np.ones((1, 1, 4), np.float32), np.ones((1, 1, 2), np.float32))
        try:
            dcn_cupy.deform_conv1d(np.ones((1, 1, 4), np.int32), np.ones((1, 1, 2), np.float32))
        except TypeError as error:
            print("REFUSED", error)
        print("BEFORE", "ml_dtypes" in sys.modules, len(_interop._SUPPORTED))
        import ml_dtypes
        x = np.ones((1, 1, 4), ml_dtypes.bfloat16)
        y = dcn_cupy.deform_conv1d(x, np.ones((1, 1, 2), ml_dtypes.bfloat16))
        print("BFLOAT16", y.dtype, y.ravel().tolist())
        print("AFTER", np.dtype(ml_dtypes.bfloat16) in _interop._SUPPORTED, _interop.BFLOAT16)
    """).stdout
    assert "REFUSED input must have dtype float16, bfloat16, float32 or float64, got int32" in out
    assert "BEFORE False 3" in out
    assert "BFLOAT16 bfloat16 [2.0, 2.0, 2.0]" in out
    assert "AFTER True bfloat16" in out


def test_bfloat16_is_on_the_fast_path_where_ml_dtypes_came_first():
    out = run_python("""
        import ml_dtypes, numpy as np
        from dcn_cupy import _interop
        print("SUPPORTED", np.dtype(ml_dtypes.bfloat16) in _interop._SUPPORTED)
    """).stdout
    assert "SUPPORTED True" in out
