"""Time fused-forward kernel variants: cuda/deform_fused.cu built with experiment switches.

    python benchmarks/fused_variants.py --defines DCN_FUSED_PACKED_BLEND=0 \
        -- --shapes '8,256,56' --tiles '256,64,64,1,0' --only-tiles

Prepends ``#define NAME VALUE`` lines for the ``--defines`` to the module source (the
experiment switches: ``DCN_FUSED_PACKED_BLEND`` in fused_common.cuh, 1 by default, 0 for the
float32 blend of the half types' corners; ``DCN_FUSED_WS_EXPERIMENT`` in deform_fused.cu, 0 by
default, 1 or 2 for ENGINE 3 without its MMAs or without its sampling, wrong results that
``--time-failures`` times anyway; ``DCN_FUSED_LOADS_AHEAD`` 2, ENGINE 3's samplers with two steps
of corner loads in flight, with ``DCN_FUSED_AHEAD_REGS`` 88 for a 64x64x32 tile's registers;
``DCN_FUSED_ROW_PHASES`` 0, ENGINE 3's samplers and sampled tile as before session 35's row
phases; ``DCN_FUSED_PEEL_LAST_STEP`` 1 or 0, ENGINE 3's samplers with their last step peeled off
their loop in every dtype or in none, where the default peels it in the half types only;
``DCN_FUSED_PROMOTE_CHANNELS`` 16, ENGINE 3's 3xTF32 products joining the float32 accumulators
every step of a 16-channel tile, where the default waits for 64 channels;
``DCN_FUSED_POSITION_ROWS`` 0, ENGINE 3's 3xTF32 MMAs as two m64n64 with the output channels as M,
where the default issues one m64n128 with the positions as M),
then runs ``fused_tiles.py`` with the
arguments after ``--`` in this process: the same checks against the strict float32 reference
and the same timings. Run it once per variant, in one device call, and compare the tables
(kernel times are GPU times, comparable across processes on one card).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--defines", default="", help="NAME=VALUE,... (empty: the default build)")
    args = parser.parse_args(own)
    defines = [d.split("=", 1) for d in args.defines.split(",") if d]
    from dcn_cupy._backends import cuda_fused
    original = cuda_fused.module_source
    prefix = "".join(f"#define {name} {value}\n" for name, value in defines)
    cuda_fused.module_source = lambda *args, **kwargs: prefix + original(*args, **kwargs)
    print(f"variant: {args.defines or 'default'}", flush=True)
    import fused_tiles
    return fused_tiles.main(rest)


if __name__ == "__main__":
    sys.exit(main())
