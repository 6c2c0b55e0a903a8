"""``python -m dcn_cupy demo``: train a small deformable CNN on scikit-learn's digits, no framework.

The network is trained with nothing but dcn_cupy's explicit forward and backward functions and
NumPy (CuPy on a GPU) — no autograd::

    x (1x8x8) -> conv 3x3, 16 ch, ReLU                                  [deform_conv2d, no offset]
              -> modulated deformable conv 3x3 stride 2, 32 ch, ReLU    [deform_conv2d]
                   offsets and mask predicted from the same features by a
                   plain conv 3x3 stride 2 (2*9 + 9 channels, zero-initialised,
                   so training starts from a plain convolution); mask = mask_sigmoid(logits)
              -> flatten (32x4x4) -> linear -> softmax cross-entropy, Adam

and the same network with a plain convolution in place of the deformable one is trained with
the same seeds, data order and epochs; both test accuracies are reported. The digits (1797
8x8 images) ship with scikit-learn, so nothing is downloaded.
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
    "    pip install scikit-learn"
)


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
# the network


def _he(rng, shape, fan_in):
    return (rng.standard_normal(shape) * math.sqrt(2.0 / fan_in)).astype(np.float32)


def init_params(seed: int, deformable: bool, xp) -> dict:
    """Parameters; the layers both variants share get the same values for the same seed."""
    rng = np.random.default_rng(seed)
    p = {
        "w1": _he(rng, (16, 1, 3, 3), 9), "b1": np.zeros(16, np.float32),
        "w2": _he(rng, (32, 16, 3, 3), 16 * 9), "b2": np.zeros(32, np.float32),
        "wf": _he(rng, (10, 32 * 4 * 4), 32 * 16) / math.sqrt(2.0), "bf": np.zeros(10, np.float32),
    }
    if deformable:  # zero: no offsets and a mask of mask_sigmoid(0) = 1 at the start
        p["wo"] = np.zeros((27, 16, 3, 3), np.float32)
        p["bo"] = np.zeros(27, np.float32)
    return {k: xp.asarray(v) for k, v in p.items()}


_CONV2 = dict(stride=2, padding=1)


def forward(p: dict, x, xp):
    """Logits and the intermediate values the backward pass needs."""
    z1 = dcn_cupy.deform_conv2d(x, p["w1"], bias=p["b1"], padding=1)
    h1 = xp.maximum(z1, 0)
    cache = {"x": x, "z1": z1, "h1": h1}
    if "wo" in p:
        om = dcn_cupy.deform_conv2d(h1, p["wo"], bias=p["bo"], **_CONV2)  # a plain convolution
        offset = xp.ascontiguousarray(om[:, :18])
        mask = dcn_cupy.mask_sigmoid(xp.ascontiguousarray(om[:, 18:]))
        cache.update(offset=offset, mask=mask)
        z2 = dcn_cupy.deform_conv2d(h1, p["w2"], offset, mask, p["b2"], **_CONV2)
    else:
        z2 = dcn_cupy.deform_conv2d(h1, p["w2"], bias=p["b2"], **_CONV2)
    h2 = xp.maximum(z2, 0).reshape(len(x), -1)
    cache.update(z2=z2, h2=h2)
    return h2 @ p["wf"].T + p["bf"], cache


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
    g = {"wf": d_logits.T @ c["h2"], "bf": d_logits.sum(axis=0)}
    d_z2 = ((d_logits @ p["wf"]).reshape(c["z2"].shape) * (c["z2"] > 0)).astype(np.float32)
    if "wo" in p:
        g2 = dcn_cupy.deform_conv2d_backward(d_z2, c["h1"], p["w2"], c["offset"], c["mask"], p["b2"], **_CONV2)
        d_mask_logits = dcn_cupy.mask_sigmoid_backward(g2.mask, c["mask"])
        d_om = xp.concatenate([g2.offset, d_mask_logits], axis=1)
        go = dcn_cupy.deform_conv2d_backward(d_om, c["h1"], p["wo"], bias=p["bo"], **_CONV2)
        g.update(wo=go.weight, bo=go.bias)
        d_h1 = g2.input + go.input
    else:
        g2 = dcn_cupy.deform_conv2d_backward(d_z2, c["h1"], p["w2"], bias=p["b2"], **_CONV2)
        d_h1 = g2.input
    g.update(w2=g2.weight, b2=g2.bias)
    d_z1 = d_h1 * (c["z1"] > 0)
    g1 = dcn_cupy.deform_conv2d_backward(d_z1, c["x"], p["w1"], bias=p["b1"], padding=1,
                                         wrt={"weight", "bias"})  # no gradient for the images
    g.update(w1=g1.weight, b1=g1.bias)
    return float(loss), correct, g


class Adam:
    def __init__(self, params: dict, lr: float, xp, lr_scale: Optional[dict] = None,
                 betas=(0.9, 0.999), eps=1e-8):
        self.lr, self.xp, self.betas, self.eps = lr, xp, betas, eps
        self.lr_scale = lr_scale or {}
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
            lr = self.lr * self.lr_scale.get(k, 1.0) * correction
            params[k] -= (lr * self.m[k] / (self.xp.sqrt(self.v[k]) + self.eps)).astype(params[k].dtype)


def accuracy(p: dict, x, labels, xp, batch: int = 256) -> float:
    correct = 0
    for i in range(0, len(x), batch):
        logits, _ = forward(p, x[i:i + batch], xp)
        correct += int((logits.argmax(axis=1) == labels[i:i + batch]).sum())
    return correct / max(len(x), 1)


def train(label: str, deformable: bool, data, args, xp, stream) -> dict:
    x_train, y_train, x_test, y_test = data
    params = init_params(args.seed, deformable, xp)
    # The offset/mask predictor learns 10x slower, as in the DCN papers.
    optimizer = Adam(params, args.lr, xp, lr_scale={"wo": 0.1, "bo": 0.1})
    order_rng = np.random.default_rng(args.seed + 1)  # same data order for both variants
    steps = math.ceil(len(x_train) / args.batch_size)
    start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        bar = Progress(f"{label:<10} epoch {epoch:>{len(str(args.epochs))}}/{args.epochs}", steps, stream)
        order = xp.asarray(order_rng.permutation(len(x_train)))
        total_loss, total_correct, seen = 0.0, 0, 0
        for step in range(steps):
            index = order[step * args.batch_size:(step + 1) * args.batch_size]
            loss, correct, grads = loss_and_grads(params, x_train[index], y_train[index], xp)
            optimizer.step(params, grads)
            total_loss += loss * len(index)
            total_correct += correct
            seen += len(index)
            bar.update(step + 1, f"loss {total_loss / seen:.4f} train acc {total_correct / seen:.3f}")
        bar.line(f"{label:<10} epoch {epoch:>{len(str(args.epochs))}}/{args.epochs}: "
                 f"loss {total_loss / seen:.4f}, train accuracy {total_correct / seen:.4f}, "
                 f"{time.perf_counter() - start:.1f} s")
    elapsed = time.perf_counter() - start
    result = {"test_accuracy": accuracy(params, x_test, y_test, xp), "seconds": elapsed}
    if deformable:
        offsets = forward(params, x_test[:256], xp)[1]["offset"]
        result["mean_abs_offset"] = float(abs(offsets).mean())
    return result


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
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[:, None]  # (1797, 1, 8, 8) in [0, 1]
    labels = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(images))
    cut = int(round(0.8 * len(images)))
    train, test = order[:cut], order[cut:]
    if train_samples:
        train = train[:train_samples]
    if test_samples:
        test = test[:test_samples]
    return tuple(xp.asarray(a) for a in (images[train], labels[train], images[test], labels[test]))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dcn_cupy demo",
        description="Train a small deformable CNN on scikit-learn's 8x8 digits with dcn_cupy's explicit "
                    "forward/backward functions only, and compare it with the same network using a plain "
                    "convolution.",
    )
    parser.add_argument("--epochs", type=int, default=15, help="training epochs per network (default 15)")
    parser.add_argument("--batch-size", type=int, default=32, help="minibatch size (default 32)")
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate (default 3e-3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the split, initialisation and data order")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="cpu (NumPy), cuda (CuPy) or auto: cuda where a GPU is visible (default)")
    parser.add_argument("--train-samples", type=int, default=None, metavar="N",
                        help="use only the first N training images (default: all, 80%% of 1797)")
    parser.add_argument("--test-samples", type=int, default=None, metavar="N",
                        help="use only the first N test images (default: all, 20%% of 1797)")
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
    xp, where = _select_device(args.device)
    data = load_data(args.seed, args.train_samples, args.test_samples, xp)
    stream = sys.stdout
    print(f"dcn_cupy {dcn_cupy.__version__} demo: digits 8x8, {len(data[0])} training / {len(data[2])} test "
          f"images, {args.epochs} epochs, batch {args.batch_size}, Adam lr {args.lr}, seed {args.seed}, "
          f"device {where}", flush=True)
    start = time.perf_counter()
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
