"""``python -m dcn_cupy demo``: a short training run, its output, and its optional dependency."""

import importlib.util
import io
import re
import sys

import numpy as np
import pytest

from dcn_cupy import _demo

ACCURACY = re.compile(r"^(deformable|plain) conv\s+test accuracy (\d\.\d+)", re.MULTILINE)


def _accuracies(text):
    return {kind: float(value) for kind, value in ACCURACY.findall(text)}


def _check_output(text, epochs):
    assert "dcn_cupy" in text and "demo" in text.splitlines()[0]
    for label in ("deformable", "plain"):
        for epoch in range(1, epochs + 1):  # one progress line per epoch when stdout is not a TTY
            assert re.search(rf"^{label}\s+epoch {epoch}/{epochs}: loss \d", text, re.MULTILINE), (label, epoch)
    assert "\r" not in text  # no bar updates outside a terminal
    accuracies = _accuracies(text)
    assert set(accuracies) == {"deformable", "plain"}, text
    assert re.search(r"^difference [+-]\d\.\d+; total time \d+\.\d s", text, re.MULTILINE)
    return accuracies


def test_short_run_learns_and_draws(capsys, tmp_path):
    pytest.importorskip("sklearn")
    picture = tmp_path / "sampling.png"
    argv = ["--epochs", "3", "--train-samples", "600", "--test-samples", "200", "--device", "cpu"]
    if importlib.util.find_spec("matplotlib") is not None:
        argv += ["--picture", str(picture)]
    status = _demo.main(argv)
    out = capsys.readouterr().out
    assert status == 0
    accuracies = _check_output(out, 3)
    assert "600 training / 200 test images" in out and "rotation" in out
    # chance is 0.1 (+-0.02 on 200 images); three short epochs on distorted digits reach ~0.27
    assert accuracies["deformable"] > 0.18 and accuracies["plain"] > 0.18, accuracies
    if "--picture" in argv:
        assert f"wrote {picture}" in out
        assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and picture.stat().st_size > 20_000


def test_warp_is_a_resampling():
    """Zero offsets leave the canvas as it is; a whole-pixel offset field shifts it."""
    rng = np.random.default_rng(0)
    canvas = _demo.digits_on_canvas(rng.uniform(0, 1, (3, 8, 8)).astype(np.float32))
    zero = np.zeros((3, 2, 16, 16), np.float32)
    np.testing.assert_array_equal(_demo.warp(canvas, zero, np), canvas)
    shift = zero.copy()
    shift[:, 1] = 2.0  # every pixel reads the one two columns to its right
    np.testing.assert_array_equal(_demo.warp(canvas, shift, np)[..., :-2], canvas[..., 2:])
    offsets = _demo.distortion_offsets(rng, 3)
    assert offsets.shape == (3, 2, 16, 16) and offsets.dtype == np.float32
    assert 0.5 < float(np.abs(offsets).mean()) < 8  # rotations and scalings move pixels by a few px


def test_sampling_positions_without_offsets_are_the_regular_grid():
    zero = {"2": np.zeros((18, 8, 8)), "3": np.zeros((18, 4, 4))}
    points = _demo.sampling_positions(zero, (1, 2))
    assert points.shape == (81, 2)
    # two stride-2 3x3 layers: 2*(tap of layer 3) + (tap of layer 2) around 4*pixel, i.e. -3..3
    assert sorted(set(map(tuple, points.astype(int)))) == [(4 + i, 8 + j) for i in range(-3, 4) for j in range(-3, 4)]
    shifted = dict(zero, **{"3": np.full((18, 4, 4), 0.5)})
    moved = _demo.sampling_positions(shifted, (1, 2))
    np.testing.assert_allclose(moved, points + 1.0)  # half a pixel on layer 2's grid is one on the input


def test_command_line_dispatch(monkeypatch):
    import dcn_cupy.__main__ as cli

    seen = []
    monkeypatch.setattr(_demo, "main", lambda argv=None: seen.append(argv) or 7)
    assert cli.main(["demo", "--epochs", "1"]) == 7
    assert seen == [["--epochs", "1"]]


def test_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        _demo.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--epochs" in out and "--device" in out


def test_missing_scikit_learn(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "sklearn", None)  # makes `import sklearn` raise ImportError
    assert _demo.main(["--epochs", "1"]) == 2
    err = capsys.readouterr().err
    assert "pip install scikit-learn" in err


def test_progress_bar_on_a_terminal():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    stream = Terminal()
    bar = _demo.Progress("deformable epoch 1/1", 4, stream, width=8)
    for step in range(1, 5):
        bar.update(step, f"loss {1 / step:.2f}", force=True)
    bar.line("deformable epoch 1/1: done")
    text = stream.getvalue()
    assert text.count("\r") >= 5 and "|########| 4/4 loss 0.25" in text
    assert text.endswith("deformable epoch 1/1: done\n")

    plain = io.StringIO()
    bar = _demo.Progress("x", 4, plain)
    bar.update(2, "half", force=True)
    bar.line("x done")
    assert plain.getvalue() == "x done\n"


@pytest.mark.gpu
def test_short_run_on_gpu(capsys):
    pytest.importorskip("sklearn")
    status = _demo.main(["--epochs", "3", "--train-samples", "600", "--test-samples", "200", "--device", "cuda"])
    out = capsys.readouterr().out
    assert status == 0 and "device cuda:" in out
    accuracies = _check_output(out, 3)
    # the CPU test's run on the GPU: chance is 0.1 (+-0.02 on 200 images), three short epochs on
    # distorted digits reach ~0.27
    assert accuracies["deformable"] > 0.18 and accuracies["plain"] > 0.18, accuracies
