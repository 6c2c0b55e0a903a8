"""How local is the fused backward's input-gradient scatter? Counted on the host (NumPy, no GPU).

    python benchmarks/scatter_locality.py [--size 56,56] [--stride 1] [--tile 64] [--sigma 1.0] \
        [--margin 1] [--blocks 200] [--seed 0]

The data kernel of ``cuda/fused-backward`` (``cuda/deform_fused_backward.cu``) gives each block
BN consecutive output positions of one sample and ONE tap, and adds every corner contribution
to the input gradient with a global vector reduction. This script takes a 'same' 3^N
deformable convolution (padding 1, dilation 1, ``--stride``; offsets drawn N(0, sigma^2) as
``benchmarks/gpu.py``'s are with sigma 1) and, for blocks of ``--tile`` consecutive positions,
counts per channel:

* the corner contributions that land on the grid (one global reduction each today);
* the distinct input pixels they touch, for one tap a block (today) and for all the taps of the
  tile in one block (what a block merging its taps in shared memory would flush);
* the box of input pixels around the tile (its output rows' span mapped to the input, the
  kernel's extent, ``--margin`` pixels each side), its volume (the shared-memory window such a
  block would hold, per channel) and the share of the contributions that fall in it.

NOTES-gpu.md ("Session 17", "The next lever") has the numbers for the benchmark shapes. Session
18 built such blocks (a float32 window, and a fixed-point one in the deterministic kernel): both
slower, since shared-memory atomics cost the multiprocessor more than the global reductions they
save (NOTES-gpu.md "Session 18").
"""

from __future__ import annotations

import argparse
import itertools
import math

import numpy as np


def count(size, stride=1, tile=64, sigma=1.0, margin=1, blocks=200, seed=0) -> dict:
    """Averages over up to ``blocks`` evenly spread position tiles of one sample: contributions,
    distinct pixels with one tap and with all taps a block, the box's volume and the share of
    contributions inside it."""
    rng = np.random.default_rng(seed)
    size = tuple(int(s) for s in size)
    n = len(size)
    out = tuple((s + 2 - 3) // stride + 1 for s in size)
    Q, K = math.prod(out), 3 ** n
    offset = rng.standard_normal((K, n) + out) * sigma
    taps = list(itertools.product(range(3), repeat=n))
    starts = np.unique(np.linspace(0, max(Q - 1, 0), num=min(blocks, -(-Q // tile))).astype(int) // tile * tile)
    totals = {"contributions": 0.0, "one_tap_pixels": 0.0, "all_taps_pixels": 0.0, "box_pixels": 0.0, "in_box": 0.0}
    for p0 in starts:
        qc = np.unravel_index(np.arange(p0, min(p0 + tile, Q)), out)
        lo = [int(qc[a].min()) * stride - 1 - margin for a in range(n)]
        hi = [int(qc[a].max()) * stride - 1 + 2 + margin for a in range(n)]     # inclusive
        lo = [max(v, 0) for v in lo]
        hi = [min(v, s - 1) for v, s in zip(hi, size)]
        totals["box_pixels"] += math.prod(h - v + 1 for v, h in zip(lo, hi))
        union = set()
        for t, tc in enumerate(taps):
            base = [np.floor(qc[a] * stride - 1 + tc[a] + offset[(t, a) + qc]).astype(np.int64) for a in range(n)]
            pixels = set()
            for corner in itertools.product((0, 1), repeat=n):
                c = [base[a] + corner[a] for a in range(n)]
                on = np.ones(len(c[0]), dtype=bool)
                inside = np.ones(len(c[0]), dtype=bool)
                for a in range(n):
                    on &= (c[a] >= 0) & (c[a] < size[a])
                    inside &= (c[a] >= lo[a]) & (c[a] <= hi[a])
                totals["contributions"] += on.sum()
                totals["in_box"] += (on & inside).sum()
                pixels.update(zip(*(v[on] for v in c)))
            totals["one_tap_pixels"] += len(pixels)
            union |= pixels
        totals["all_taps_pixels"] += len(union)
    blocks = len(starts)
    return {
        "blocks": blocks,
        "contributions": totals["contributions"] / blocks,
        "one_tap_pixels": totals["one_tap_pixels"] / blocks,      # summed over the K taps' blocks
        "all_taps_pixels": totals["all_taps_pixels"] / blocks,
        "box_pixels": totals["box_pixels"] / blocks,
        "in_box": totals["in_box"] / max(totals["contributions"], 1),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/scatter_locality.py", description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="56,56", help="spatial size of the input, e.g. 4096 or 56,56 or 32,32,32")
    parser.add_argument("--stride", type=int, default=1)
    parser.add_argument("--tile", type=int, default=64, help="positions a block (BN)")
    parser.add_argument("--sigma", type=float, default=1.0, help="standard deviation of the offsets")
    parser.add_argument("--margin", type=int, default=1, help="pixels of the box beyond the kernel's extent")
    parser.add_argument("--blocks", type=int, default=200, help="position tiles sampled")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    size = tuple(int(v) for v in args.size.split(","))
    r = count(size, args.stride, args.tile, args.sigma, args.margin, args.blocks, args.seed)
    K = 3 ** len(size)
    print(f"size {'x'.join(map(str, size))}, stride {args.stride}, {args.tile} positions a block, offsets "
          f"N(0, {args.sigma:g}^2), {r['blocks']} blocks; per channel and position tile:")
    print(f"  contributions on the grid (global reductions today): {r['contributions']:.0f}")
    print(f"  distinct pixels, one tap a block ({K} blocks): {r['one_tap_pixels']:.0f} "
          f"({r['contributions'] / max(r['one_tap_pixels'], 1):.2f}x fewer)")
    print(f"  distinct pixels, all {K} taps in one block: {r['all_taps_pixels']:.0f} "
          f"({r['contributions'] / max(r['all_taps_pixels'], 1):.2f}x fewer)")
    print(f"  box around the tile (margin {args.margin}): {r['box_pixels']:.0f} pixels, "
          f"{100 * r['in_box']:.1f}% of the contributions inside")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
