"""``python -m dcn_cupy demo``: a short training run, its output, and its optional dependency."""

import io
import re
import sys

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


def test_short_run_learns(capsys):
    pytest.importorskip("sklearn")
    status = _demo.main(["--epochs", "2", "--train-samples", "400", "--test-samples", "300", "--device", "cpu"])
    out = capsys.readouterr().out
    assert status == 0
    accuracies = _check_output(out, 2)
    assert "400 training / 300 test images" in out
    # chance is 0.1; two epochs on 400 images reach ~0.8 for both networks
    assert accuracies["deformable"] > 0.5 and accuracies["plain"] > 0.5, accuracies


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
    status = _demo.main(["--epochs", "2", "--train-samples", "400", "--test-samples", "300", "--device", "cuda"])
    out = capsys.readouterr().out
    assert status == 0 and "device cuda:" in out
    accuracies = _check_output(out, 2)
    assert accuracies["deformable"] > 0.5 and accuracies["plain"] > 0.5, accuracies
