"""``python -m dcn_cupy demo``: deformable against plain convolutions on distorted digits, no framework.

The task is one where sampling positions matter: scikit-learn's 8x8 digits (shipped with it,
nothing is downloaded) are drawn on a 16x16 canvas under a random rotation (up to 40 degrees),
scaling (0.9x to 1.7x), shift and elastic distortion, fresh distortions every epoch; the test
set has its own fixed distortions. The distortions themselves are computed by dcn_cupy: a 1x1
deformable convolution with weight 1 samples the canvas at displaced positions.

Two networks are trained with the same seeds, initial weights and data order, with nothing but
dcn_cupy's explicit forward and backward functions and NumPy (CuPy on a GPU)::

    x (1x16x16) -> conv 3x3, 8 ch, ReLU
                -> deformable conv 3x3 stride 2, 16 ch, ReLU   (8x8)
                -> deformable conv 3x3 stride 2, 32 ch, ReLU   (4x4)
                -> flatten (32x4x4) -> linear -> softmax cross-entropy, Adam

In the deformable network, each deformable layer's offsets and mask (DCNv2) are predicted from
its input by a plain 3x3 convolution, zero-initialised, so training starts from the plain
network. The plain network uses plain convolutions there. Both test accuracies are reported;
with ``--picture FILE.png`` (matplotlib) the learned sampling positions of a few output pixels of
the last layer are drawn over test images, as in the DCN paper's figure.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Optional

import numpy as np

import dcn_cupy

__all__ = ["main"]

_SKLEARN_MISSING = (
    "The demo needs scikit-learn for its dataset (the 8x8 digits that ship with it):\n"
    "    pip install scikit-learn      (or pip install \"dcn_cupy[demo]\")"
)
CANVAS = 16


# ---------------------------------------------------------------------------------------------
# progress bar (plain text; \r updates on a terminal, one line per epoch otherwise)


class Progress:
    def __init__(self, label: str, total: int, stream=None, width: int = 24):
        self.label, self.total, self.width = label, total, width
        self.stream = stream if stream is not None else sys.stdout
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last = 0.0

    def update(self, done: int, text: str, force: bool = False) -> None:
        if not self.tty:
            return
        now = time.perf_counter()
        if not force and done < self.total and now - self._last < 0.1:
            return
        self._last = now
        filled = int(round(self.width * done / max(self.total, 1)))
        bar = "#" * filled + "-" * (self.width - filled)
        self.stream.write(f"\r{self.label} |{bar}| {done}/{self.total} {text}\033[K")
        self.stream.flush()

    def line(self, text: str) -> None:
        """A finished line: replaces the bar on a terminal, else printed as is."""
        if self.tty:
            self.stream.write("\r\033[K")
        self.stream.write(text + "\n")
        self.stream.flush()


# ---------------------------------------------------------------------------------------------
# distorted digits, warped by dcn_cupy itself


def _upsample_matrix(coarse: int, fine: int) -> np.ndarray:
    """``(fine, coarse)`` linear interpolation weights (the corners aligned)."""
    positions = np.linspace(0, coarse - 1, fine)
    low = np.minimum(np.floor(positions).astype(int), coarse - 2)
    frac = positions - low
    matrix = np.zeros((fine, coarse))
    matrix[np.arange(fine), low] = 1 - frac
    matrix[np.arange(fine), low + 1] = frac
    return matrix


def distortion_offsets(rng, count: int, max_angle=40.0, scales=(0.9, 1.7), shift=1.5, elastic=0.8) -> np.ndarray:
    """``(count, 2, 16, 16)`` float32 offsets: output pixel q samples the canvas at q + offset[q],
    the inverse of a random rotation and scaling about the centre, a shift, plus a smooth
    random (elastic) displacement."""
    n = CANVAS
    angle = np.deg2rad(rng.uniform(-max_angle, max_angle, count))
    scale = np.exp(rng.uniform(np.log(scales[0]), np.log(scales[1]), count))
    move = rng.uniform(-shift, shift, (count, 2))
    centre = (n - 1) / 2
    grid = np.stack(np.meshgrid(np.arange(n), np.arange(n), indexing="ij")).astype(np.float64) - centre  # (2, n, n)
    cos, sin = np.cos(angle) / scale, np.sin(angle) / scale
    # inverse map: rotate by -angle, shrink by 1/scale
    src_y = cos[:, None, None] * grid[0] + sin[:, None, None] * grid[1]
    src_x = -sin[:, None, None] * grid[0] + cos[:, None, None] * grid[1]
    source = np.stack([src_y, src_x], axis=1) + centre - move[:, :, None, None]
    up = _upsample_matrix(4, n)
    field = np.einsum("ia,ncab,jb->ncij", up, rng.standard_normal((count, 2, 4, 4)), up) * elastic
    return (source + field - (grid + centre)).astype(np.float32)


def warp(canvas, offsets, xp):
    """Each pixel sampled at its displaced position (bilinear, zeros outside): a 1x1 deformable
    convolution with weight 1."""
    return dcn_cupy.deform_conv2d(canvas, xp.ones((1, 1, 1, 1), canvas.dtype), offsets)


def digits_on_canvas(images) -> np.ndarray:
    """``(N, 1, 16, 16)`` float32: the 8x8 digits, in [0, 1], in the middle of the canvas."""
    canvas = np.zeros((len(images), 1, CANVAS, CANVAS), np.float32)
    lo = (CANVAS - 8) // 2
    canvas[:, 0, lo:lo + 8, lo:lo + 8] = images
    return canvas


# ---------------------------------------------------------------------------------------------
# the network


def _he(rng, shape, fan_in):
    return (rng.standard_normal(shape) * math.sqrt(2.0 / fan_in)).astype(np.float32)


_LAYERS = (("1", 1, 8, 1), ("2", 8, 16, 2), ("3", 16, 32, 2))  # name, C_in, C_out, stride
_DEFORMABLE = ("2", "3")


def init_params(seed: int, deformable: bool, xp) -> dict:
    """Parameters; the layers both variants share get the same values for the same seed."""
    rng = np.random.default_rng(seed)
    p = {}
    for name, c_in, c_out, _ in _LAYERS:
        p["w" + name], p["b" + name] = _he(rng, (c_out, c_in, 3, 3), 9 * c_in), np.zeros(c_out, np.float32)
    p["wf"], p["bf"] = _he(rng, (10, 32 * 16), 32 * 16) / math.sqrt(2.0), np.zeros(10, np.float32)
    if deformable:  # zero: no offsets and a mask of mask_sigmoid(0) = 1 at the start
        for name in _DEFORMABLE:
            c_in = dict((n, c) for n, c, _, _ in _LAYERS)[name]
            p["wo" + name], p["bo" + name] = np.zeros((27, c_in, 3, 3), np.float32), np.zeros(27, np.float32)
    return {k: xp.asarray(v) for k, v in p.items()}


def forward(p: dict, x, xp):
    """Logits and the intermediate values the backward pass needs."""
    cache, h = {}, x
    for name, _, _, stride in _LAYERS:
        conv = dict(stride=stride, padding=1)
        cache["in" + name] = h
        if "wo" + name in p:
            om = dcn_cupy.deform_conv2d(h, p["wo" + name], bias=p["bo" + name], **conv)  # a plain convolution
            offset = xp.ascontiguousarray(om[:, :18])
            mask = dcn_cupy.mask_sigmoid(xp.ascontiguousarray(om[:, 18:]))
            cache["offset" + name], cache["mask" + name] = offset, mask
            z = dcn_cupy.deform_conv2d(h, p["w" + name], offset, mask, p["b" + name], **conv)
        else:
            z = dcn_cupy.deform_conv2d(h, p["w" + name], bias=p["b" + name], **conv)
        cache["z" + name] = z
        h = xp.maximum(z, 0)
    flat = h.reshape(len(h), -1)
    cache["flat"], cache["h_last"] = flat, h
    return flat @ p["wf"].T + p["bf"], cache


def loss_and_grads(p: dict, x, labels, xp):
    logits, c = forward(p, x, xp)
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_prob = shifted - xp.log(xp.exp(shifted).sum(axis=1, keepdims=True))
    n = len(x)
    loss = -log_prob[xp.arange(n), labels].mean()
    correct = int((logits.argmax(axis=1) == labels).sum())

    d_logits = xp.exp(log_prob)
    d_logits[xp.arange(n), labels] -= 1
    d_logits /= n
    g = {"wf": d_logits.T @ c["flat"], "bf": d_logits.sum(axis=0)}
    d_h = (d_logits @ p["wf"]).reshape(c["h_last"].shape)
    for name, _, _, stride in reversed(_LAYERS):
        conv = dict(stride=stride, padding=1)
        d_z = xp.ascontiguousarray(d_h * (c["z" + name] > 0)).astype(np.float32)
        x_in = c["in" + name]
        first = name == _LAYERS[0][0]
        if "wo" + name in p:
            gm = dcn_cupy.deform_conv2d_backward(d_z, x_in, p["w" + name], c["offset" + name], c["mask" + name],
                                                 p["b" + name], **conv)
            d_mask_logits = dcn_cupy.mask_sigmoid_backward(gm.mask, c["mask" + name])
            d_om = xp.concatenate([gm.offset, d_mask_logits], axis=1)
            go = dcn_cupy.deform_conv2d_backward(d_om, x_in, p["wo" + name], bias=p["bo" + name], **conv)
            g.update({"wo" + name: go.weight, "bo" + name: go.bias})
            d_h = gm.input + go.input
        else:
            wrt = {"weight", "bias"} if first else None  # no gradient for the images
            gm = dcn_cupy.deform_conv2d_backward(d_z, x_in, p["w" + name], bias=p["b" + name], **conv, wrt=wrt)
            d_h = gm.input
        g.update({"w" + name: gm.weight, "b" + name: gm.bias})
    return float(loss), correct, g


class Adam:
    def __init__(self, params: dict, lr: float, xp, betas=(0.9, 0.999), eps=1e-8):
        self.lr, self.xp, self.betas, self.eps = lr, xp, betas, eps
        self.m = {k: xp.zeros_like(v) for k, v in params.items()}
        self.v = {k: xp.zeros_like(v) for k, v in params.items()}
        self.t = 0

    def step(self, params: dict, grads: dict) -> None:
        self.t += 1
        b1, b2 = self.betas
        correction = math.sqrt(1 - b2 ** self.t) / (1 - b1 ** self.t)
        for k, g in grads.items():
            self.m[k] = b1 * self.m[k] + (1 - b1) * g
            self.v[k] = b2 * self.v[k] + (1 - b2) * g * g
            params[k] -= (self.lr * correction * self.m[k] / (self.xp.sqrt(self.v[k]) + self.eps)).astype(params[k].dtype)


def accuracy(p: dict, x, labels, xp, batch: int = 256) -> float:
    correct = 0
    for i in range(0, len(x), batch):
        logits, _ = forward(p, x[i:i + batch], xp)
        correct += int((logits.argmax(axis=1) == labels[i:i + batch]).sum())
    return correct / max(len(x), 1)


def train(label: str, deformable: bool, data, args, xp, stream) -> dict:
    canvases, y_train, x_test, y_test = data
    params = init_params(args.seed, deformable, xp)
    # The offset/mask predictors learn at the full rate: the DCN papers' 0.1x is for fine-tuning
    # pretrained networks; this one trains from scratch for a few epochs.
    optimizer = Adam(params, args.lr, xp)
    data_rng = np.random.default_rng(args.seed + 1)  # same data order and distortions for both variants
    steps = math.ceil(len(canvases) / args.batch_size)
    start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        bar = Progress(f"{label:<10} epoch {epoch:>{len(str(args.epochs))}}/{args.epochs}", steps, stream)
        order = data_rng.permutation(len(canvases))
        offsets = xp.asarray(distortion_offsets(data_rng, len(canvases)))  # fresh distortions every epoch
        total_loss, total_correct, seen = 0.0, 0, 0
        for step in range(steps):
            index = xp.asarray(order[step * args.batch_size:(step + 1) * args.batch_size])
            images = warp(canvases[index], offsets[index], xp)
            loss, correct, grads = loss_and_grads(params, images, y_train[index], xp)
            optimizer.step(params, grads)
            total_loss += loss * len(index)
            total_correct += correct
            seen += len(index)
            bar.update(step + 1, f"loss {total_loss / seen:.4f} train acc {total_correct / seen:.3f}")
        bar.line(f"{label:<10} epoch {epoch:>{len(str(args.epochs))}}/{args.epochs}: "
                 f"loss {total_loss / seen:.4f}, train accuracy {total_correct / seen:.4f}, "
                 f"{time.perf_counter() - start:.1f} s")
    elapsed = time.perf_counter() - start
    result = {"test_accuracy": accuracy(params, x_test, y_test, xp), "seconds": elapsed, "params": params}
    if deformable:
        cache = forward(params, x_test[:256], xp)[1]
        result["mean_abs_offset"] = float(np.mean([float(abs(cache["offset" + n]).mean()) for n in _DEFORMABLE]))
    return result


# ---------------------------------------------------------------------------------------------
# the picture: where the last layer samples the input


def _bilinear(field, y, x):
    """``field`` (C, H, W) at the fractional position (y, x), zeros outside (as the convolution)."""
    _, h, w = field.shape
    y0, x0 = math.floor(y), math.floor(x)
    total = np.zeros(field.shape[0])
    for yy, wy in ((y0, 1 - (y - y0)), (y0 + 1, y - y0)):
        for xx, wx in ((x0, 1 - (x - x0)), (x0 + 1, x - x0)):
            if 0 <= yy < h and 0 <= xx < w:
                total += wy * wx * field[:, yy, xx]
    return total


def sampling_positions(offsets: dict, pixel) -> np.ndarray:
    """``(81, 2)`` input positions (y, x) that one output pixel of layer 3 reads through layers 3
    and 2: each of its 9 taps lands on layer 2's output grid, where layer 2's 9 taps (with the
    offsets interpolated there) land on the input. ``offsets[name]``: (18, H, W) of one image."""
    taps = [(i - 1, j - 1) for i in range(3) for j in range(3)]  # 3x3, padding 1, dilation 1
    points = []
    for t3, (dy3, dx3) in enumerate(taps):
        p2 = (pixel[0] * 2 + dy3 + offsets["3"][2 * t3, pixel[0], pixel[1]],
              pixel[1] * 2 + dx3 + offsets["3"][2 * t3 + 1, pixel[0], pixel[1]])
        shift2 = _bilinear(offsets["2"], *p2)
        for t2, (dy2, dx2) in enumerate(taps):
            points.append((p2[0] * 2 + dy2 + shift2[2 * t2], p2[1] * 2 + dx2 + shift2[2 * t2 + 1]))
    return np.asarray(points)


def draw(path: str, images, offsets: dict, labels, predicted, pixels=((1, 1), (2, 2), (1, 2))) -> None:
    """Test images with the sampling positions of a few layer-3 output pixels (one colour each)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    count = len(images)
    fig, axes = plt.subplots(1, count, figsize=(2.6 * count, 3.0), squeeze=False)
    colours = ("#e41a1c", "#377eb8", "#4daf4a", "#ff7f00")
    for k, ax in enumerate(axes[0]):
        ax.imshow(images[k, 0], cmap="gray_r", vmin=0, vmax=1, extent=(-0.5, CANVAS - 0.5, CANVAS - 0.5, -0.5))
        for pixel, colour in zip(pixels, colours):
            points = sampling_positions({n: offsets[n][k] for n in offsets}, pixel)
            ax.scatter(points[:, 1], points[:, 0], s=7, color=colour, alpha=0.75, linewidths=0)
            centre = (pixel[0] * 4, pixel[1] * 4)  # where the undeformed 3x3 windows of both layers centre
            ax.scatter([centre[1]], [centre[0]], s=60, marker="+", color=colour)
        ax.set_title(f"label {labels[k]}, predicted {predicted[k]}", fontsize=9)
        ax.set_xlim(-3, CANVAS + 2)
        ax.set_ylim(CANVAS + 2, -3)
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle("learned sampling positions: 81 input points read by one output pixel (+) of the last "
                 "deformable layer, through both deformable layers", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# command line


def _select_device(choice: str):
    """``(xp, description)``; ``choice`` is auto, cpu or cuda."""
    if choice == "cpu":
        return np, "cpu (NumPy + Numba)"
    from ._interop import cupy_or_none

    cupy = cupy_or_none()
    count = 0
    if cupy is not None:
        try:
            count = cupy.cuda.runtime.getDeviceCount()
        except Exception:
            count = 0
    if count == 0:
        if choice == "cuda":
            raise SystemExit("error: --device cuda needs CuPy and a visible CUDA device "
                             "(run `python -m dcn_cupy info`)")
        return np, "cpu (NumPy + Numba)"
    return cupy, f"cuda:{cupy.cuda.Device().id} (CuPy)"


def load_data(seed: int, train_samples: Optional[int], test_samples: Optional[int], xp):
    """Training canvases (distorted anew each epoch), their labels, distorted test images, labels."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    canvases = digits_on_canvas((digits.images / 16.0).astype(np.float32))
    labels = digits.target.astype(np.int64)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(canvases))
    cut = int(round(0.8 * len(canvases)))
    train, test = order[:cut], order[cut:]
    if train_samples:
        train = train[:train_samples]
    if test_samples:
        test = test[:test_samples]
    test_images = warp(xp.asarray(canvases[test]), xp.asarray(distortion_offsets(rng, len(test))), xp)
    return xp.asarray(canvases[train]), xp.asarray(labels[train]), test_images, xp.asarray(labels[test])


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dcn_cupy demo",
        description="Train a small deformable CNN and the same network with plain convolutions on scikit-learn's "
                    "digits under random rotation, scaling and elastic distortion, with dcn_cupy's explicit "
                    "forward/backward functions only; compare their test accuracies and draw where the "
                    "deformable network samples.",
    )
    parser.add_argument("--epochs", type=int, default=10, help="training epochs per network (default 10)")
    parser.add_argument("--batch-size", type=int, default=32, help="minibatch size (default 32)")
    parser.add_argument("--lr", type=float, default=5e-3, help="Adam learning rate (default 5e-3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the split, distortions, initialisation and "
                                                            "data order (default 0)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="cpu (NumPy), cuda (CuPy) or auto: cuda where a GPU is visible (default)")
    parser.add_argument("--train-samples", type=int, default=None, metavar="N",
                        help="use only the first N training digits (default: all, 80%% of 1797)")
    parser.add_argument("--test-samples", type=int, default=None, metavar="N",
                        help="use only the first N test digits (default: all, 20%% of 1797)")
    parser.add_argument("--picture", default=None, metavar="FILE.png",
                        help="draw the learned sampling positions over test images into FILE.png (matplotlib)")
    return parser


def main(argv=None) -> int:
    """Run the demo with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.epochs < 1 or args.batch_size < 1:
        print("error: --epochs and --batch-size must be >= 1", file=sys.stderr)
        return 2
    try:
        import sklearn  # noqa: F401
    except ImportError:
        print(_SKLEARN_MISSING, file=sys.stderr)
        return 2
    if args.picture:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print('--picture needs matplotlib: pip install matplotlib (or pip install "dcn_cupy[plot]")',
                  file=sys.stderr)
            return 2
    xp, where = _select_device(args.device)
    start = time.perf_counter()
    data = load_data(args.seed, args.train_samples, args.test_samples, xp)
    stream = sys.stdout
    print(f"dcn_cupy {dcn_cupy.__version__} demo: digits distorted on a 16x16 canvas (rotation +-40 deg, "
          f"scale 0.9-1.7, elastic), {len(data[0])} training / {len(data[2])} test images, {args.epochs} epochs, "
          f"batch {args.batch_size}, Adam lr {args.lr}, seed {args.seed}, device {where}", flush=True)
    results = {}
    for label, deformable in (("deformable", True), ("plain", False)):
        results[label] = train(label, deformable, data, args, xp, stream)
        print(f"{label:<10} test accuracy {results[label]['test_accuracy']:.4f} "
              f"({results[label]['seconds']:.1f} s)", flush=True)
    d, p = results["deformable"], results["plain"]
    print()
    print(f"deformable conv test accuracy {d['test_accuracy']:.4f}  (mean |offset| {d['mean_abs_offset']:.3f} px)")
    print(f"plain conv      test accuracy {p['test_accuracy']:.4f}")
    print(f"difference {d['test_accuracy'] - p['test_accuracy']:+.4f}; total time {time.perf_counter() - start:.1f} s",
          flush=True)
    if args.picture:
        x_test, y_test = data[2][:4], data[3][:4]
        logits, cache = forward(d["params"], x_test, xp)
        host = (lambda a: a.get()) if xp is not np else np.asarray
        draw(args.picture, host(x_test), {n: host(cache["offset" + n]) for n in _DEFORMABLE},
             host(y_test), host(logits.argmax(axis=1)))
        print(f"wrote {args.picture}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
