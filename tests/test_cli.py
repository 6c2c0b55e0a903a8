"""The command line: ``python -m dcn_cupy info / check / bench`` (bench --plot included)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dcn_cupy import __main__ as cli
from dcn_cupy import _bench, _info
from dcn_cupy._backends import cpu

REPO = Path(__file__).resolve().parent.parent


def test_info_reports_the_kernel_cache_the_backend_uses(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("DCN_CUPY_NUMBA_CACHE", str(tmp_path / "kernels"))
    assert cli.main(["info"]) == 0
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("Numba cache"))
    assert str(tmp_path / "kernels") in line and cpu.cache_location() == str(tmp_path / "kernels")
    monkeypatch.setenv("DCN_CUPY_NUMBA_CACHE", "0")
    assert cli.main(["info"]) == 0
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("Numba cache"))
    assert line.split(None, 2)[2].startswith("off"), line


def test_info_mentions_numba_and_cpu_backend(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "numba" in out.lower()
    assert "threads" in out
    assert "dcn_cupy" in out and "NumPy" in out and "ml_dtypes" in out
    assert "Backends:" in out
    assert "  cpu " in out
    assert "threadpoolctl" in out and "Numba cache" in out
    for framework in ("PyTorch", "JAX", "TensorFlow", "Keras"):
        assert framework in out
    if not _info.cuda_devices():
        assert "cuda  none" in out


def test_info_imports_no_framework():
    """info reads versions from metadata: it imports no deep-learning framework (and is fast)."""
    code = ("import sys; from dcn_cupy.__main__ import main; main(['info']); "
            "print('IMPORTED', sorted(m for m in ('torch', 'jax', 'tensorflow', 'keras') if m in sys.modules))")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "IMPORTED []" in result.stdout


def test_check_cpu_passes(capsys):
    assert cli.main(["check", "--device", "cpu", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    for name in ("deform_conv1d forward", "deform_conv3d grad offset", "deform_conv_transpose2d grad mask",
                 "deform_conv_transpose3d forward", "mask_softmax2d grad", "mask_sigmoid grad"):
        assert name in out
    assert "MISMATCH" not in out and "ERROR" not in out
    assert "passed" in out
    assert "max rel. error" in out  # the summary table
    # the table is printed once: one row per case, no per-case progress lines repeating it
    assert out.count("deform_conv2d grad offset") == 1
    assert out.count("mask_sigmoid grad") == 1


def test_check_reports_a_wrong_forward(monkeypatch, capsys):
    original = cpu.conv_forward

    def wrong(x, weight, offset, mask, bias, geom, out=None):
        y = original(x, weight, offset, mask, bias, geom)
        return y + np.asarray(1e-3, dtype=y.dtype)

    monkeypatch.setattr(cpu, "conv_forward", wrong)
    assert cli.main(["check", "--device", "cpu", "-k", "deform_conv2d forward"]) == 1
    out = capsys.readouterr().out
    assert "MISMATCH" in out
    assert "FAILED" in out
    table = out.split("max rel. error", 1)[1]
    assert "deform_conv2d forward" in table and "MISMATCH" in table


def test_check_reports_a_wrong_gradient_and_an_exception(monkeypatch, capsys):
    original = cpu.conv_backward

    def wrong(*args, **kwargs):
        grad_x, grad_w, grad_off, grad_m = original(*args, **kwargs)
        return grad_x, grad_w, None if grad_off is None else grad_off * 1.01, grad_m

    def broken(*args, **kwargs):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(cpu, "conv_backward", wrong)
    assert cli.main(["check", "--device", "cpu", "-k", "deform_conv1d grad offset"]) == 1
    out = capsys.readouterr().out
    assert "MISMATCH" in out

    monkeypatch.setattr(cpu, "conv_backward", broken)
    assert cli.main(["check", "--device", "cpu", "-k", "deform_conv_transpose1d forward float64"]) == 1
    out = capsys.readouterr().out
    assert "ERROR" in out and "kernel exploded" in out


def test_check_unavailable_backend_or_no_match(capsys):
    if not _info.cuda_devices():
        assert cli.main(["check", "--device", "cuda"]) == 2
        assert "not available" in capsys.readouterr().err
    assert cli.main(["check", "--device", "cpu", "-k", "no such case"]) == 2


def test_no_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as excinfo:
        cli.main([])
    assert excinfo.value.code == 2


def test_bench_falls_back_to_cpu(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(_info, "cuda_devices", lambda: [])
    folder = tmp_path / "benchmarks"
    folder.mkdir()
    (folder / "cpu.py").write_text("def main(argv=None):\n    print('cpu bench', argv)\n    return 0\n")
    monkeypatch.setattr(_bench, "benchmarks_dir", lambda: folder)
    assert cli.main(["bench", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "cpu bench ['--repeats', '1']" in out

    # A GPU but no gpu.py: say so and fall back to the CPU benchmark.
    monkeypatch.setattr(_info, "cuda_devices", lambda: [(0, "Fake GPU", "9.0")])
    monkeypatch.setattr(_bench, "torch_installed", lambda: True)
    assert cli.main(["bench"]) == 0
    out = capsys.readouterr().out
    assert "gpu.py is missing" in out and "cpu bench" in out

    (folder / "gpu.py").write_text("def main(argv=None):\n    print('gpu bench', argv)\n    return 3\n")
    assert cli.main(["bench", "-x"]) == 3
    assert "gpu bench ['-x']" in capsys.readouterr().out

    # A GPU and gpu.py, but no torch (which gpu.py needs): say so and fall back.
    monkeypatch.setattr(_bench, "torch_installed", lambda: False)
    assert cli.main(["bench"]) == 0
    out = capsys.readouterr().out
    assert "PyTorch is not installed" in out and "cpu bench" in out

    monkeypatch.setattr(_bench, "benchmarks_dir", lambda: tmp_path / "nowhere")
    assert cli.main(["bench"]) == 2
    assert "not installed with the package" in capsys.readouterr().err


_FAKE_CPU_BENCH = """
import json
def main(argv=None):
    path = argv[argv.index("--json") + 1]
    rows = [{"library": lib, "mode": mode, "median_ms": ms}
            for lib, mode, ms in (("dcn_cupy", "forward", 10.0), ("dcn_cupy", "forward+backward", 50.0),
                                  ("torchvision", "forward", 60.0), ("torchvision", "forward+backward", 500.0))]
    json.dump({"benchmark": "cpu", "config": {"batch": 2, "in_channels": 4, "out_channels": 4, "size": [8, 8],
               "dtype": "float32"}, "environment": {}, "results": rows}, open(path, "w"))
    return 0
"""


def test_bench_plot_writes_a_png_and_nothing_else(monkeypatch, capsys, tmp_path):
    pytest.importorskip("matplotlib")
    monkeypatch.setattr(_info, "cuda_devices", lambda: [])
    folder = tmp_path / "benchmarks"
    folder.mkdir()
    (folder / "cpu.py").write_text(_FAKE_CPU_BENCH)
    monkeypatch.setattr(_bench, "benchmarks_dir", lambda: folder)
    monkeypatch.chdir(tmp_path)
    png = tmp_path / "out" / "bench.png"
    assert cli.main(["bench", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert f"wrote {png}" in capsys.readouterr().out
    # the scratch JSON the plot was drawn from is gone; nothing else was written
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["bench.png", "cpu.py"]


def test_plot_reads_the_gpu_benchmark_format(tmp_path):
    pytest.importorskip("matplotlib")
    import json

    from dcn_cupy import _plot
    rows = [{"impl": impl, "shape": "2D B=8", "precision": p, "fwd_ms": ms, "fwdbwd_ms": 4 * ms}
            for impl, ms in (("dcn_cupy", 1.0), ("torchvision", 2.0)) for p in ("fp32", "fp16")]
    rows.append({"impl": "torchvision", "shape": "3D", "precision": "fp32", "error": "no 3D"})
    report = {"meta": {"device": "Fake GPU"}, "results": rows}
    assert len(_plot.records(report)) == 8
    path = tmp_path / "g.json"
    path.write_text(json.dumps(report))
    _plot.plot_file(path, tmp_path / "g.png")
    assert (tmp_path / "g.png").stat().st_size > 10_000


def test_cpu_benchmark_targets_come_from_benchmarks_readme():
    module = _bench.load_script(REPO / "benchmarks" / "cpu.py", "_test_cpu_targets")
    targets = module.read_targets()
    assert set(targets) == {"forward", "forward+backward"}
    assert all(limit > 0 for limit, _ in targets.values())


def test_real_cpu_benchmark_smoke(tmp_path, capsys):
    """benchmarks/cpu.py at a tiny shape: prints a table and writes JSON."""
    import json

    out_json = tmp_path / "cpu.json"
    module = _bench.load_script(REPO / "benchmarks" / "cpu.py", "_test_cpu_benchmark")
    assert module.main(["--batch", "1", "--in-channels", "4", "--out-channels", "4", "--size", "8",
                        "--warmup", "0", "--repeats", "2", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "Numba threads" in out and "median ms" in out
    report = json.loads(out_json.read_text())
    modes = {(r["library"], r["mode"]) for r in report["results"]}
    assert ("dcn_cupy", "forward") in modes and ("dcn_cupy", "forward+backward") in modes
    for algorithm in ("cpu/numba", "cpu/channels-last"):  # each CPU algorithm, forced
        assert (f"dcn_cupy {algorithm}", "forward+backward") in modes
    assert "dcn_cupy's automatic choice: forward: cpu/numba" in out  # 4 channels: runs under 16


def test_cpu_algorithms_benchmark_smoke(capsys):
    """benchmarks/cpu_algorithms.py --quick: a row per case, both CPU algorithms timed."""
    module = _bench.load_script(REPO / "benchmarks" / "cpu_algorithms.py", "_test_cpu_algorithms")
    assert module.main(["--quick", "--repeats", "1"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows[0].split()[:3] == ["case", "numba", "fwd"] and len(rows) == 1 + len(module.QUICK)
    assert all(len(row.split()) == 10 for row in rows[1:]), rows  # label (4 words), 6 numbers


def test_cold_start_benchmark_smoke(capsys, tmp_path):
    """benchmarks/cold_start.py: one cold child process (an empty kernel cache of its own) of this
    tree, its times in the table and the JSON."""
    module = _bench.load_script(REPO / "benchmarks" / "cold_start.py", "_test_cold_start")
    out = tmp_path / "cold.json"
    assert module.main(["--channels", "8", "--rounds", "1", "--json", str(out)]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows[1].split()[:3] == ["tree", "C", "forward"] and len(rows) == 3, rows
    assert rows[2].split()[1:3] == ["8", "cpu/numba"], rows
    (case,) = json.loads(out.read_text())
    (run,) = case["runs"]
    assert case["channels"] == 8 and 0 < run["import"] < run["process"] and 0 < run["fb"] < run["process"]


def test_ab_benchmark_parses_its_cases_and_steps_aside_without_a_gpu(capsys, monkeypatch):
    """benchmarks/ab.py: cases are gpu.py's shapes by key with a precision, values Python literals
    (a value may repeat), a bad one named in the error; without a CUDA device it says so and
    exits 0."""
    module = _bench.load_script(REPO / "benchmarks" / "ab.py", "_test_ab")
    cases = module.parse_cases("3dt-fp32,14-tf32")
    assert [(shape["name"], precision, name) for shape, precision, name in cases] == [
        ("3D transposed B=2 C32 16^3 s2", "fp32", "3dt-fp32"), ("2D B=16 C512->512 14x14 3x3", "tf32", "14-tf32")]
    assert cases[0][0]["transposed"] and not cases[1][0].get("transposed")
    assert len(module.shapes()) == len(module.SHAPE_KEYS)
    with pytest.raises(ValueError, match="SHAPE-PRECISION .* got '3dt-fp64'"):
        module.parse_cases("3dt-fp32,3dt-fp64")
    with pytest.raises(ValueError, match="got 'c128-fp16'"):
        module.parse_cases("c128-fp16")
    # --shape KEY=B,C_in,C_out,S: a shape of one's own, gpu.py's 'same' convolution
    key, shape = module.parse_shape("c128=8,128,128,56x56")
    assert key == "c128" and shape == {"name": "c128 B=8 C128->128 56x56", "B": 8, "C_in": 128, "C_out": 128,
                                       "S": (56, 56)}
    ((own, precision, name),) = module.parse_cases("c128-fp16", {key: shape})
    assert own is shape and (precision, name) == ("fp16", "c128-fp16")
    for bad in ("c128=8,128,56x56", "=8,128,128,56x56", "c-1=8,128,128,56x56", "c64=8,64,64,56x56",
                "c128=8,128,128,56y56"):
        with pytest.raises(ValueError, match=f"KEY=B,C_in,C_out,S .* got '{bad}'"):
            module.parse_shape(bad)
    with pytest.raises(SystemExit):
        module.main(["cuda.GEMM_SPLITS", "--shape", "c128=8,128", "--cases", "c128-fp32"])
    assert "--shape must be KEY=B,C_in,C_out,S" in capsys.readouterr().err
    assert module.parse_values("False, True, 2") == [False, True, 2]
    assert module.parse_values("4,8,4") == [4, 8, 4]
    with pytest.raises(ValueError, match="Python literals .* got 'False,maybe'"):
        module.parse_values("False,maybe")
    with pytest.raises(ValueError, match="at least two values"):
        module.parse_values("4")
    with pytest.raises(SystemExit):
        module.main(["cuda.GEMM_SPLITS", "--cases", "3dt-fp32", "--rounds", "0"])
    assert "--rounds must be at least 1, got 0" in capsys.readouterr().err
    monkeypatch.setattr(module._gpu, "no_gpu_reason", lambda: "no CUDA device visible to CuPy")
    assert module.main(["cuda_fused_backward.EARLY_COPIES", "--cases", "2dt-bf16"]) == 0
    assert "benchmarks/ab.py: no CUDA device visible to CuPy: nothing to measure." in capsys.readouterr().out
    # (--set is checked once there is a device to run on)
    assert module.main(["cuda_fused_backward.WS_LOADS_AHEAD", "--set", "cuda_fused_backward.NOPE=1"]) == 0


def test_ab_benchmark_holds_other_settings(capsys, monkeypatch):
    """benchmarks/ab.py --set MODULE.NAME=VALUE (a setting held through the run) parses as
    warm_modules.py's --set; a setting it cannot find, or the switch the A/B turns, is an error."""
    pytest.importorskip("cupy")
    module = _bench.load_script(REPO / "benchmarks" / "ab.py", "_test_ab_set")
    assert module.parse_setting("cuda_fused_backward.WS_CHANNEL_ROWS=False") == (
        "dcn_cupy._backends.cuda_fused_backward", "WS_CHANNEL_ROWS", False)
    monkeypatch.setattr(module._gpu, "no_gpu_reason", lambda: None)
    monkeypatch.setattr(module._bench, "torch_installed", lambda: True)
    for setting, message in (("cuda_fused_backward.NOPE=1", "--set: dcn_cupy._backends.cuda_fused_backward has no "
                                                            "setting 'NOPE'"),
                             ("cuda_fused_backward.WS_LOADS_AHEAD=False", "--set holds cuda_fused_backward."
                                                                          "WS_LOADS_AHEAD, the switch that the A/B turns")):
        with pytest.raises(SystemExit):
            module.main(["cuda_fused_backward.WS_LOADS_AHEAD", "--set", setting])
        assert message in capsys.readouterr().err, setting


def test_ab_benchmark_tables_each_values_times_and_peak(capsys, monkeypatch, tmp_path):
    """benchmarks/ab.py's table and JSON (``run_case`` stubbed, no GPU needed): per case and value
    the best f+b and backward times, their ratios to the case's first value, and the f+b peak MiB;
    the switch set back afterwards."""
    import json
    pytest.importorskip("cupy")
    module = _bench.load_script(REPO / "benchmarks" / "ab.py", "_test_ab_table")
    from dcn_cupy._backends import cuda_fused_backward as fb
    monkeypatch.setattr(module._gpu, "no_gpu_reason", lambda: None)
    monkeypatch.setattr(module._bench, "torch_installed", lambda: True)
    monkeypatch.setattr(module._gpu, "_device_name", lambda: "a card")
    seen = []

    def run_case(m, attribute, values, shape, precision, rounds, timing, deterministic=False):
        seen.append((m.__name__, attribute, values, shape["name"], precision, rounds))
        return [(values[0], 2.0, 1.0, 120.0, "its plan"), (values[1], 1.5, 0.8, 96.5, "its plan")]

    monkeypatch.setattr(module, "run_case", run_case)
    before = fb.REDUCED_SPLITS
    out_json = tmp_path / "ab.json"
    assert module.main(["cuda_fused_backward.REDUCED_SPLITS", "--cases", "14-fp16,c256-tf32", "--rounds", "2",
                        "--json", str(out_json)]) == 0
    assert fb.REDUCED_SPLITS is before
    assert seen == [("dcn_cupy._backends.cuda_fused_backward", "REDUCED_SPLITS", [False, True],
                     "2D B=16 C512->512 14x14 3x3", "fp16", 2),
                    ("dcn_cupy._backends.cuda_fused_backward", "REDUCED_SPLITS", [False, True],
                     "2D B=8 C256->256 56x56 3x3", "tf32", 2)]
    out = capsys.readouterr().out
    assert "14-fp16: its plan" in out
    assert "| case | value | f+b | backward | f+b ratio | backward ratio | f+b peak MiB |" in out
    assert "| 14-fp16 | False | 2.0000 | 1.0000 | 1.000 | 1.000 | 120.0 |" in out
    assert "| c256-tf32 | True | 1.5000 | 0.8000 | 0.750 | 0.800 | 96.5 |" in out
    report = json.loads(out_json.read_text())
    assert report["device"] == "a card" and len(report["results"]) == 4
    assert report["results"][1] == {"case": "14-fp16", "shape": "2D B=16 C512->512 14x14 3x3", "precision": "fp16",
                                    "value": "True", "fwdbwd_ms": 1.5, "bwd_ms": 0.8, "fwdbwd_peak_mib": 96.5,
                                    "algorithm": "its plan"}


#: Three rows of ncu's --csv output for one backward (H200, session 66), with ncu's own lines.
_NCU_CSV = """==PROF== Connected to process 988
kernel_times plan: conv_backward (backward): cuda/fused-backward: 3xtf32 wgmma, chunks of 4 samples
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","988","python3.12","127.0.0.1","void fused_channels_last_vectors_split<int>(const float *, float *, int, int, int, T1, T1, float *, float *, T1, int)","1","7","(256, 1, 1)","(144, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","ns","6,400"
"1","988","python3.12","127.0.0.1","void fused_channels_last_vectors<float, int>(const T1 *, T1 *, int, int, int, T2, T2, dcn::Traits<T1>::acc *, T1 *, T2, int)","1","7","(256, 1, 1)","(784, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","ns","10,176"
"2","988","python3.12","127.0.0.1","void fused_channels_last_vectors_split<int>(const float *, float *, int, int, int, T1, T1, float *, float *, T1, int)","1","7","(256, 1, 1)","(784, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","us","14.208"
==PROF== Disconnected from process 988
"""


def test_kernel_times_sums_ncu_rows_per_kernel(capsys, monkeypatch):
    """benchmarks/kernel_times.py: ncu's CSV rows summed per kernel (its name without template
    arguments), in the order of first launch, units to µs, ncu's other lines skipped; a bad
    --phases named; without a CUDA device it says so and exits 0."""
    module = _bench.load_script(REPO / "benchmarks" / "kernel_times.py", "_test_kernel_times")
    times = module.kernel_times(_NCU_CSV)
    assert [(name, launches) for name, launches, _ in times] == [("fused_channels_last_vectors_split", 2),
                                                                  ("fused_channels_last_vectors", 1)]
    assert times[0][2] == pytest.approx(6.4 + 14.208) and times[1][2] == pytest.approx(10.176)
    assert module.kernel_times("==PROF== nothing profiled\n") == []
    with pytest.raises(ValueError, match="in 'cycles'"):
        module.kernel_times(_NCU_CSV.replace('"us","14.208"', '"cycles","14"'))
    text = module.table("14-fp32", "backward", "its plan", times)
    assert text.splitlines()[0] == "14-fp32 backward: its plan"
    assert text.splitlines()[-1] == "| total | 3 | 30.8 |"
    with pytest.raises(SystemExit):
        module.main(["--cases", "14-fp32", "--phases", "backward,both"])
    assert "--phases must be comma-separated, of forward, backward, got 'backward,both'" in capsys.readouterr().err
    monkeypatch.setattr(module.ab._gpu, "no_gpu_reason", lambda: "no CUDA device visible to CuPy")
    assert module.main(["--cases", "14-fp32,1d-tf32", "--phases", "forward,backward"]) == 0
    assert "benchmarks/kernel_times.py: no CUDA device visible to CuPy: nothing to measure." in capsys.readouterr().out


def test_kernel_times_runs_each_case_and_phase_under_ncu(capsys, monkeypatch, tmp_path):
    """benchmarks/kernel_times.py runs a process of its own under the ncu command line for each
    case and phase (the profiled one told its case and phase, the --set settings passed on) and
    prints each one's table, or ncu's last lines where it failed (here: a stand-in for ncu that
    prints call 4's rows, and fails for the forward)."""
    module = _bench.load_script(REPO / "benchmarks" / "kernel_times.py", "_test_kernel_times_runs")
    (tmp_path / "rows.csv").write_text(_NCU_CSV)
    fake = tmp_path / "fake-ncu"
    fake.write_text('#!/bin/sh\necho "$@" >> "%s"\ncase "$*" in *:forward*) echo broken; exit 3;; esac\n'
                    'cat "%s"\n' % (tmp_path / "calls", tmp_path / "rows.csv"))
    fake.chmod(0o755)
    monkeypatch.setattr(module.ab._gpu, "no_gpu_reason", lambda: None)
    monkeypatch.setattr(module.ab._bench, "torch_installed", lambda: True)
    monkeypatch.setattr(module.ab._gpu, "_device_name", lambda: "a card")
    assert module.main(["--shape", "c128=8,128,128,56x56", "--cases", "c128-fp32", "--phases", "forward,backward",
                        "--ncu", str(fake)]) == 0
    out = capsys.readouterr().out
    assert "kernel_times on a card: ncu's gpu__time_duration" in out
    assert "c128-fp32 forward: ncu exited with 3 and 0 kernels; its last lines:\nbroken" in out
    assert ("c128-fp32 backward: conv_backward (backward): cuda/fused-backward: 3xtf32 wgmma, chunks of 4 samples\n"
            "| kernel | launches | µs |") in out and "| total | 3 | 30.8 |" in out
    calls = (tmp_path / "calls").read_text().splitlines()
    assert len(calls) == 2 and all(" ".join(module.NCU_OPTIONS) in call for call in calls)
    assert [call.split("--profile ")[1].split()[0] for call in calls] == ["c128-fp32:forward", "c128-fp32:backward"]
    assert all("--shape c128=8,128,128,56x56" in call for call in calls)
    # --set (its module needs CuPy): passed on to the profiled process, named in the heading
    pytest.importorskip("cupy")
    assert module.main(["--cases", "14-fp32", "--ncu", str(fake), "--set", "cuda_fused.WORKSPACE_LIMIT_BYTES=1"]) == 0
    assert "kernel_times on a card, cuda_fused.WORKSPACE_LIMIT_BYTES=1" in capsys.readouterr().out
    assert "--set cuda_fused.WORKSPACE_LIMIT_BYTES=1" in (tmp_path / "calls").read_text().splitlines()[-1]


def test_gpu_benchmark_ratios_put_bf16_against_torchvision_fp16():
    """gpu.py's ``add_ratios``: a dcn_cupy row gets its time and peak ratios against torchvision
    and cuDNN of its shape and precision; bf16, where torchvision's row is an error, goes against
    torchvision's fp16 (issue 8's target), and cuDNN's bf16 stays cuDNN's bf16."""
    gpu = _bench.load_script(REPO / "benchmarks" / "gpu.py", "_test_gpu_ratios")

    def row(precision, impl, fwd, fwdbwd, peak):
        return dict(shape="s", precision=precision, impl=impl, fwd_ms=fwd, fwdbwd_ms=fwdbwd,
                    fwd_peak_mib=peak, fwdbwd_peak_mib=2 * peak)

    results = [row("fp16", "dcn_cupy", 0.1, 0.5, 20), row("fp16", "torchvision", 0.4, 4.0, 100),
               row("fp16", "dense conv (cuDNN)", 0.08, 0.3, 10), row("bf16", "dcn_cupy", 0.2, 1.0, 25),
               dict(shape="s", precision="bf16", impl="torchvision", error="NotImplementedError"),
               row("bf16", "dense conv (cuDNN)", 0.05, 0.25, 10), row("bf16", "dcn_cupy transposed", 0.1, 1.0, 5),
               dict(shape="s", precision="tf32", impl="dcn_cupy", error="failed")]
    gpu.add_ratios(results)
    fp16, bf16 = results[0], results[3]
    assert fp16["fwd_speedup_vs_tv"] == pytest.approx(4.0) and fp16["fwdbwd_speedup_vs_tv"] == pytest.approx(8.0)
    assert fp16["fwd_peak_ratio_vs_tv"] == pytest.approx(0.2) and fp16["fwd_speedup_vs_dense"] == pytest.approx(0.8)
    assert bf16["fwd_speedup_vs_tv"] == pytest.approx(2.0) and bf16["fwdbwd_speedup_vs_tv"] == pytest.approx(4.0)
    assert bf16["fwdbwd_peak_ratio_vs_tv"] == pytest.approx(0.25)
    assert bf16["fwd_speedup_vs_dense"] == pytest.approx(0.25) and bf16["fwdbwd_speedup_vs_dense"] == pytest.approx(0.25)
    assert not any(key.startswith("fwd_speedup") for key in results[6]) and "fwd_speedup_vs_tv" not in results[7]


def test_sanitize_forces_each_fused_backward_data_tile(monkeypatch):
    """sanitize.py's fused-backward cases force each data tile through ``TILES``: the rule takes
    the list's first (narrow) or second (wide) tile and, in 3D, the narrow one for the input
    gradient alone, so every one of them must be the forced tile (a one-tile list broke the rule's
    unpacking, and the run stopped at its first forced tile)."""
    pytest.importorskip("cupy")
    sanitize = _bench.load_script(REPO / "benchmarks" / "sanitize.py", "_test_sanitize_tiles")
    from dcn_cupy._backends import cuda_fused_backward as fb
    from dcn_cupy._geometry import ConvGeometry
    tiles = fb.TILES
    for key, dtype in (("half", np.float16), ("float", np.float32)):
        for tile in tiles[key]:
            monkeypatch.setattr(fb, "TILES", sanitize.forcing_data_tile(tiles, key, tile))
            for ndim, channels in ((2, 16), (2, 256), (3, 16), (1, 512)):
                geom = ConvGeometry(ndim, 2, channels, channels, 1, 1, 1, (3,) * ndim, (1,) * ndim, (1,) * ndim,
                                    (1,) * ndim, (8,) * ndim, (8,) * ndim)
                config = fb.BackwardConfig(geom, dtype, False, wgmma=True)
                assert config.tile == tile and config.scatter_tile == tile, (key, tile, ndim, channels)
                assert "tile {}x{}x{},".format(*tile[:3]) in config.description
    monkeypatch.setattr(fb, "TILES", tiles)
    assert fb.BackwardConfig(ConvGeometry(3, 2, 16, 16, 1, 1, 1, (3,) * 3, (1,) * 3, (1,) * 3, (1,) * 3, (8,) * 3,
                                          (8,) * 3), np.float16, False, wgmma=True).tile == tiles["half"][1]


def test_sanitize_ndims_option_splits_the_fused_backward():
    """sanitize.py's ``--ndims`` (the fused backward's dimensions, so that its racecheck, longer
    than a device call, runs in parts): a comma-separated subset of 1, 2 and 3, all by default;
    anything else is refused before the script looks for a GPU, naming the option and the text."""
    sanitize = _bench.load_script(REPO / "benchmarks" / "sanitize.py", "_test_sanitize_ndims")
    assert sanitize.ndims_option(["sanitize.py", "--fused-backward-only"]) == (1, 2, 3)
    assert sanitize.ndims_option(["sanitize.py", "--fused-backward-only", "--ndims", "3"]) == (3,)
    assert sanitize.ndims_option(["sanitize.py", "--ndims", "2,1", "--fused-quick"]) == (1, 2)
    for text in ("4", "1,x", ""):
        with pytest.raises(ValueError, match=f"--ndims takes a comma-separated list of 1, 2 and 3, got {text!r}"):
            sanitize.ndims_option(["sanitize.py", "--ndims", text])
    with pytest.raises(ValueError, match="got ''"):
        sanitize.ndims_option(["sanitize.py", "--ndims"])
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "sanitize.py"), "--fused-backward-only",
                             "--ndims", "0,3"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "--ndims takes a comma-separated list of 1, 2 and 3, got '0,3'" in result.stderr


def test_benchmark_cases_build_conv_and_transposed_inputs(monkeypatch):
    """gpu.py's ``transposed_case`` (which ``bench_transposed`` and ab.py take) and ab.py's
    plain case, on NumPy stand-ins for torch's and CuPy's arrays: the transposed weight is
    (C_in, C_out, 3^N), grad_output on the doubled grid, offsets and mask on the input's, in the
    precision's dtype; stride 2, padding 1, output padding 1, TF32 only for tf32."""
    import types

    module = _bench.load_script(REPO / "benchmarks" / "ab.py", "_test_ab_cases")
    gpu = module._gpu
    rng = np.random.default_rng(0)

    def make_inputs(shape, dtype, seed=0):   # gpu._make_inputs' shapes, NumPy
        B, C_in, C_out, S = shape["B"], shape["C_in"], shape["C_out"], shape["S"]
        n, K = len(S), 3 ** len(S)
        return tuple(rng.standard_normal(s).astype(dtype) for s in (
            (B, C_in) + S, (C_out, C_in) + (3,) * n, (C_out,), (B, n * K) + S, (B, K) + S, (B, C_out) + S))

    monkeypatch.setattr(gpu, "_make_inputs", make_inputs)
    monkeypatch.setattr(gpu, "_as_cupy", lambda *arrays: arrays)
    monkeypatch.setattr(gpu, "_set_precision", lambda precision: np.float16 if precision == "fp16" else np.float32)
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(
        random=types.SimpleNamespace(default_rng=np.random.default_rng), float32=np.float32))
    shape = module.shapes()["3dt"]
    (x, w, off, msk, b), gy, keywords = module._case_arguments(shape, "fp16")
    assert x.shape == (2, 32, 16, 16, 16) and w.shape == (32, 32, 3, 3, 3) and b.shape == (32,)
    assert off.shape == (2, 81, 16, 16, 16) and msk.shape == (2, 27, 16, 16, 16)
    assert gy.shape == (2, 32, 32, 32, 32)
    assert {a.dtype for a in (x, w, off, msk, b, gy)} == {np.dtype(np.float16)}
    assert keywords == dict(stride=2, padding=1, output_padding=1, transposed=True, allow_tf32=False)
    assert module._case_arguments(module.shapes()["2dt"], "tf32")[2]["allow_tf32"] is True
    (x, w, off, msk, b), gy, keywords = module._case_arguments(module.shapes()["14"], "tf32")
    assert x.shape == gy.shape == (16, 512, 14, 14) and w.shape == (512, 512, 3, 3)
    assert keywords == dict(padding=1, allow_tf32=True)


def test_ab_benchmark_resolves_backend_settings():
    """benchmarks/ab.py's switch: MODULE.NAME, a module-level setting of a backend module (or
    of ``_plan``), or plan.KEYWORD; anything else is refused with a message naming it."""
    pytest.importorskip("cupy")
    module = _bench.load_script(REPO / "benchmarks" / "ab.py", "_test_ab_switch")
    found, name = module.resolve_switch("cuda_fused_backward.EARLY_COPIES")
    assert name == "EARLY_COPIES" and found.__name__ == "dcn_cupy._backends.cuda_fused_backward"
    assert module.resolve_switch("_plan.CHAIN_TRANSPOSED_BACKWARD")[0].__name__ == "dcn_cupy._plan"
    assert module.resolve_switch("plan.deterministic") == (None, "deterministic")
    with pytest.raises(ValueError, match="dcn_cupy.plan has no keyword 'nope'"):
        module.resolve_switch("plan.nope")
    with pytest.raises(ValueError, match="dcn_cupy._backends.cuda has no setting 'NOPE'"):
        module.resolve_switch("cuda.NOPE")
    with pytest.raises(ValueError, match="must be MODULE.NAME .* got 'EARLY_COPIES'"):
        module.resolve_switch("EARLY_COPIES")
    with pytest.raises(ValueError, match="dcn_cupy._backends.nosuch cannot be imported"):
        module.resolve_switch("nosuch.X")


def test_scatter_locality_counts_a_hand_case(capsys):
    """benchmarks/scatter_locality.py: 1D, 4 positions in one block, offsets 0 (sigma 0). Taps 0 /
    1 / 2 put their corners at q - 1 + t and q + t: 7 / 7 / 5 on the grid (19), touching 4 / 4 / 3
    pixels (11 over the three one-tap blocks) and 4 in all; the box (margin 1) is the whole
    4-pixel input."""
    module = _bench.load_script(REPO / "benchmarks" / "scatter_locality.py", "_test_scatter_locality")
    r = module.count((4,), stride=1, tile=4, sigma=0.0, margin=1, blocks=1)
    assert r == {"blocks": 1, "contributions": 19, "one_tap_pixels": 11, "all_taps_pixels": 4, "box_pixels": 4,
                 "in_box": 1.0}
    many = module.count((12, 12), tile=16, blocks=5)
    assert many["all_taps_pixels"] <= many["one_tap_pixels"] <= many["contributions"]
    assert 0.0 < many["in_box"] <= 1.0
    assert module.main(["--size", "9,9", "--tile", "16", "--blocks", "3"]) == 0
    assert "all 9 taps in one block" in capsys.readouterr().out


def test_sass_counts_opcodes_and_names_what_is_missing(tmp_path, capsys):
    """benchmarks/sass.py: the opcode histogram of a hand-written nvdisasm listing (predicated
    instructions and modifiers counted by opcode; labels, directives and comments not), an
    unknown source named; with a libnvrtc and nvdisasm installed (the CUDA wheels), a real
    kernel's count."""
    module = _bench.load_script(REPO / "benchmarks" / "sass.py", "_test_sass")
    listing = "\n".join([
        "\t.text.k:",
        ".L_x_0:",
        "        /*0000*/                   LDC R1, c[0x0][0x28] ;",
        "        /*0010*/                   IMAD.MOV.U32 R0, RZ, RZ, R1 ;",
        "        /*0020*/              @!P0 BRA `(.L_x_0) ;",
        "        /*0030*/               @P1 IMAD.WIDE R2, R0, 0x4, R2 ;",
        "        /*0040*/                   RED.E.ADD.F32x4.FTZ.RN.STRONG.GPU [R2.64], R4 ;  /* comment */",
        "        // a comment line",
    ])
    assert module.opcode_counts(listing) == {"LDC": 1, "IMAD": 2, "BRA": 1, "RED": 1}
    # two builds are compared by their instructions, addresses and comment lines aside
    assert module.instructions(listing)[:2] == ["LDC R1, c[0x0][0x28] ;", "IMAD.MOV.U32 R0, RZ, RZ, R1 ;"]
    assert len(module.instructions(listing)) == 5
    moved = listing.replace("/*0010*/", "/*0110*/").replace("// a comment line", "")
    assert module.instructions(moved) == module.instructions(listing)
    assert module.instructions(listing.replace("R0, 0x4", "R0, 0x8")) != module.instructions(listing)
    pytest.importorskip("cupy")   # the module text and the compile options come from the CUDA backend
    with pytest.raises(SystemExit):
        module.main(["fused_channels_last<float, int>", "--nvdisasm", "/bin/true",
                     "--nvrtc", str(tmp_path / "none.so")])
    assert "--nvrtc: no libnvrtc" in capsys.readouterr().err
    with pytest.raises(SystemExit):   # (any existing file passes the --nvrtc check; the source comes next)
        module.main(["fused_channels_last<float, int>", "--source", "nope.cu", "--nvdisasm", "/bin/true",
                     "--nvrtc", module.__file__])
    assert "--source: no cuda/nope.cu" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        module.main(["fused_channels_last<float, int>", "--same-as", str(tmp_path), "--nvdisasm", "/bin/true",
                     "--nvrtc", module.__file__])
    assert f"--same-as: no {tmp_path / 'cuda' / 'deform_fused_backward.cu'}" in capsys.readouterr().err
    nvrtc, nvdisasm = module._in_site_packages("lib", "libnvrtc.so.13"), module._default_nvdisasm()
    if nvrtc is None or nvdisasm is None:
        pytest.skip("no libnvrtc / nvdisasm wheels here: the real compilation is not run")
    assert module.main(["fused_channels_last<float, int>", "--listing", str(tmp_path / "sass.txt")]) == 0
    out = capsys.readouterr().out
    assert "fused_channels_last<float, int> (sm_90):" in out and "LDG" in (tmp_path / "sass.txt").read_text()
    # this tree against itself: every kernel the same
    assert module.main(["fused_channels_last<float, int>", "fused_store<float, int>", "--same-as", str(REPO)]) == 0
    assert f"2 of 2 the same as {REPO}'s" in capsys.readouterr().out


def test_ncu_source_sums_a_hand_written_export(tmp_path, capsys):
    """benchmarks/ncu_source.py: a source-page export of three kernels, the first and third of the
    same SASS (one kernel launched twice: added up), read per opcode, stall reason and instruction."""
    module = _bench.load_script(REPO / "benchmarks" / "ncu_source.py", "_test_ncu_source")
    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
              "Instructions Executed", "stall_long_sb", "stall_wait", "stall_long_sb (Not Issued)"]
    sass = [("0x10", "LDG.E.U16.CONSTANT R8, desc[UR12][R10.64]", "2", "4", "1,000", "0", "2", "9"),
            ("0x20", "@P0 HADD2.F32 R8, -RZ, R8.H0_H0", "30", "25", "1,000", "28", "2", "9"),
            ("0x30", "  IMAD.MOV.U32 R9, RZ, RZ, R8", "8", "1", "3,000", "1", "7", "9")]
    rows = [["void kernel_a<float>(float *)"], header, *map(list, sass),
            ["void kernel_b()"], header, ["0x10", "EXIT", "0", "0", "10", "0", "0", "0"],
            ["void kernel_a<float>(float *)"], header, *map(list, sass)]
    found = module.kernels(rows)
    assert [k["title"] for k in found] == ["void kernel_a<float>(float *)", "void kernel_b()",
                                          "void kernel_a<float>(float *)"]
    assert [len(k["rows"]) for k in found] == [3, 1, 3]
    groups = module.merged(found)
    assert [numbers for numbers, _ in groups] == [[1, 3], [2]]
    text = module.summary(groups[0][1], top=2)
    lines = text.splitlines()
    assert lines[0] == ("void kernel_a<float>(float *): 3 SASS instructions, 10,000 warp instructions "
                        "executed, 80 stall samples")
    # per opcode, the most sampled first: HADD2 60 of 80 samples, IMAD 16, LDG 4 left out by --top 2
    assert lines[2].split() == ["HADD2", "2,000", "20.0", "60", "75.0"]
    assert lines[3].split() == ["IMAD", "6,000", "60.0", "16", "20.0"]
    assert lines[4] == "  stall reasons: long_sb 72.5%, wait 27.5%"   # the Not Issued column left out
    assert lines[6].split()[:4] == ["1", "2,000", "60", "long_sb:56"] and lines[6].endswith("R8.H0_H0")
    assert lines[7].split()[0] == "2" and len(lines) == 8
    path = tmp_path / "source.csv"
    path.write_text("\n".join(",".join(f'"{cell}"' for cell in row) for row in rows) + "\n")
    assert module.main([str(path), "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert out.count("kernel 1 + 3, void kernel_a") == 1 and "kernel 2, void kernel_b(): 1 SASS" in out
    assert "LDG.E.U16.CONSTANT" in out
    (tmp_path / "empty.csv").write_text("a,b\n1,2\n")
    with pytest.raises(SystemExit):
        module.main([str(tmp_path / "empty.csv")])
    assert "has no source page" in capsys.readouterr().err
    (tmp_path / "basic.csv").write_text('"Address","Source","Instructions Executed"\n"0x0","EXIT","1"\n')
    with pytest.raises(SystemExit):
        module.main([str(tmp_path / "basic.csv")])
    assert "no column 'Warp Stall Sampling (All Samples)'" in capsys.readouterr().err


def test_module_entry_point_runs_as_subprocess(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    command = [sys.executable, "-m", "dcn_cupy", "check", "--device", "cpu", "-k", "mask_sigmoid"]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "mask_sigmoid grad" in result.stdout and "passed" in result.stdout
    result = subprocess.run(command[:3], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "usage" in result.stderr


def test_warm_modules_packs_and_unpacks_the_kernel_cache(capsys, monkeypatch, tmp_path):
    """benchmarks/warm_modules.py --pack / --unpack: the cache (nested files) comes back byte for
    byte from pieces of at most the piece size, an earlier pack's extra pieces are removed, and
    missing pieces, pieces that are no xz tar, or a member outside the cache are refused by name
    before anything is written."""
    pytest.importorskip("cupy")
    import io
    import tarfile
    module = _bench.load_script(REPO / "benchmarks" / "warm_modules.py", "_test_warm_modules_pack")
    cache = tmp_path / "cache"
    (cache / "sub").mkdir(parents=True)
    rng = np.random.default_rng(0)
    files = {"a.cubin": rng.bytes(3000), "sub/b.json": b'{"k": 1}', "c.cubin": rng.bytes(5000)}
    for name, data in files.items():
        (cache / name).write_bytes(data)
    prefix = tmp_path / "out" / "kcache"
    pieces = module.pack_cache(cache, prefix, piece_bytes=1024)
    assert [piece.name for piece in pieces] == [f"kcache.{n:02d}" for n in range(len(pieces))] and len(pieces) > 3
    assert all(piece.stat().st_size <= 1024 for piece in pieces)
    assert module.unpack_cache(prefix, tmp_path / "back") == 3
    assert {name: (tmp_path / "back" / name).read_bytes() for name in files} == files
    # a second pack in fewer pieces leaves none of the first's behind
    assert len(module.pack_cache(cache, prefix)) == 1
    assert sorted(path.name for path in prefix.parent.iterdir()) == ["kcache.00"]
    assert module.unpack_cache(prefix, tmp_path / "again") == 3
    with pytest.raises(ValueError, match=r"--unpack: expected pieces .*'\.00, \.01, \.\.\., found none"):
        module.unpack_cache(tmp_path / "nope", tmp_path / "x")
    (tmp_path / "junk.00").write_bytes(b"not a tar")
    with pytest.raises(ValueError, match=r"--unpack: the 1 pieces .*junk'\.NN are not an xz tar"):
        module.unpack_cache(tmp_path / "junk", tmp_path / "x")
    evil = io.BytesIO()
    with tarfile.open(fileobj=evil, mode="w:xz") as tar:
        info = tarfile.TarInfo("../escaped")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    (tmp_path / "evil.00").write_bytes(evil.getvalue())
    with pytest.raises(ValueError, match=r"member '\.\./escaped' .* is not a file under the cache"):
        module.unpack_cache(tmp_path / "evil", tmp_path / "x")
    assert not (tmp_path / "escaped").exists()
    with pytest.raises(ValueError, match=r"--pack: the kernel cache '.*nothing' is not a folder"):
        module.pack_cache(tmp_path / "nothing", prefix)
    # through main, without a CUDA device: unpack, nothing built, pack
    import gpu
    monkeypatch.setattr(gpu, "no_gpu_reason", lambda: "no CUDA device visible to CuPy")
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path / "main-cache"))
    assert module.main(["--unpack", str(prefix), "--pack", str(tmp_path / "repacked")]) == 0
    out = capsys.readouterr().out
    assert "unpacked 3 files from" in out and "nothing to compile" in out and "into 1 pieces" in out
    assert module.unpack_cache(tmp_path / "repacked", tmp_path / "third") == 3
    assert (tmp_path / "third" / "sub" / "b.json").read_bytes() == files["sub/b.json"]
    with pytest.raises(SystemExit):
        module.main(["--unpack", str(tmp_path / "nope")])
    assert "--unpack: expected pieces" in capsys.readouterr().err


def test_warm_modules_lists_every_backend_module_and_checks_its_arguments(capsys, monkeypatch):
    """benchmarks/warm_modules.py: one task per module each backend can build (the fused sm_90a
    engines and the fused backward's sm_90a modules first), or of the keys asked for; its
    arguments checked; without a CUDA device it compiles nothing and exits 0 (with one, that
    path is left to the GPU machine: it compiles every module)."""
    pytest.importorskip("cupy")
    module = _bench.load_script(REPO / "benchmarks" / "warm_modules.py", "_test_warm_modules")
    from dcn_cupy._backends import cuda, cuda_direct, cuda_fused, cuda_fused_backward
    tasks = module.tasks(list(module.BACKENDS))
    expected = {"fused": len(cuda_fused.all_module_keys()),   # (the fused backward: sm_90 and sm_90a modules)
                "fused-backward": 2 * len(cuda_fused_backward.all_module_keys()),
                "im2col": len(cuda.all_module_keys()), "direct": len(cuda_direct.all_module_keys()),
                "deterministic": len(cuda.all_module_keys())}
    assert {name: sum(task[0] == name for task in tasks) for name in module.BACKENDS} == expected
    assert len(set(tasks)) == len(tasks)
    wgmma = [i for i, (name, key) in enumerate(tasks)
             if (name == "fused" and key[3] in (1, 3)) or (name == "fused-backward" and key[3])]
    # (the slowest first)
    assert wgmma == list(range(len(wgmma))) and len(wgmma) > len(cuda_fused_backward.all_module_keys())
    # the keys of some dtypes, N and one index width alone
    some = module.tasks(["fused-backward", "im2col"], [np.dtype(np.float32)], [2], [32])
    assert sorted(some) == sorted([("fused-backward", (np.dtype(np.float32), 2, False, True)),
                                   ("fused-backward", (np.dtype(np.float32), 2, False, False)),
                                   ("im2col", (np.dtype(np.float32), 2, False))])
    assert some[0] == ("fused-backward", (np.dtype(np.float32), 2, False, True))
    both = module.tasks(["im2col"], [np.dtype(np.float32)], [2], [32, 64])
    assert sorted(both) == [("im2col", (np.dtype(np.float32), 2, False)), ("im2col", (np.dtype(np.float32), 2, True))]
    with pytest.raises(SystemExit):
        module.main(["--backends", "fused,nope"])
    assert "--backends: unknown nope" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        module.main(["--dtypes", "float8"])
    assert "--dtypes: expected names among float16, bfloat16, float32, float64, got 'float8'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        module.main(["--ndims", "4"])
    assert "--ndims: expected numbers among 1,2,3, got '4'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        module.main(["--index", "32,16"])
    assert "--index: expected widths among 32,64, got '32,16'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        module.main(["--jobs", "0"])
    assert "--jobs must be at least 1, got 0" in capsys.readouterr().err
    # a switch set in every worker: the modules of its other value
    setting = module.parse_setting("cuda_fused_backward.WS_LOADS_AHEAD=False")
    assert setting == ("dcn_cupy._backends.cuda_fused_backward", "WS_LOADS_AHEAD", False)
    monkeypatch.setattr(cuda_fused_backward, "WS_LOADS_AHEAD", cuda_fused_backward.WS_LOADS_AHEAD)
    module.apply_settings([setting])
    assert cuda_fused_backward.WS_LOADS_AHEAD is False
    for text, message in (("cuda_fused_backward.WS_LOADS_AHEAD", "expected MODULE.NAME=VALUE"),
                          ("cuda_fused_backward.NOPE=1", "has no setting 'NOPE'"),
                          ("nope.X=1", "cannot be imported"),
                          ("cuda_fused_backward.WS_LOADS_AHEAD=yes", "'yes' is not a Python literal")):
        with pytest.raises(SystemExit):
            module.main(["--set", text])
        assert message in capsys.readouterr().err, text
    import gpu
    monkeypatch.setattr(gpu, "no_gpu_reason", lambda: "no CUDA device visible to CuPy")
    assert module.main(["--backends", "im2col"]) == 0
    assert "no CUDA device visible to CuPy: nothing to compile" in capsys.readouterr().out
