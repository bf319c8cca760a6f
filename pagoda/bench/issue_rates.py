"""What one core of this CPU issues: 512-bit `vpdpbusd` and fused multiply-adds a second, alone and next to the
other instructions of the Q4_1 tile (pagoda/layers/q4_gemm.cpp), and what an OpenMP parallel region and a barrier
cost (pagoda/bench/issue_rates.cpp). It says which of the tile's instructions share execution ports with its
`vpdpbusd`, so how near the tile can get to the `vpdpbusd` rate, and what the one-call forward's ~150 kernel
calls a step spend handing work to the threads.

    python -m pagoda.bench.issue_rates

Prints one JSON object: `vpdpbusd_per_s` and `fma_per_s` (one core, G a second), `add_chain_ghz` (a chain of
dependent integer adds, one a cycle: the core's clock), per mix the cycles 8 `vpdpbusd` and its companions take
(`cycles_per_8_vpdpbusd`; 8.0 where the companions issue on other ports), and the microseconds of an empty
parallel region and of a barrier on all threads. Medians over --repeats. AVX-512 VNNI CPUs only (the mixes); the
OpenMP figures everywhere.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
from pathlib import Path

from pagoda.bench.common import machine_info
from pagoda.layers.cpp_build import load_library

# pagoda_issue_rates_loop's mixes past the first two: 8 vpdpbusd a step and ...
MIXES = {2: "4 shifts + 8 ANDs (nibble unpacking)", 3: "2 int-to-float + 3 integer adds",
         4: "2 float16-to-float (the scales)", 5: "1 multiply + 2 multiply-adds (the tile's float work)"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20_000_000, help="loop steps a timing (12 instructions each)")
    p.add_argument("--omp-steps", type=int, default=200_000, help="parallel regions (and barriers) a timing")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    lib = load_library(Path(__file__).with_name("issue_rates.cpp"), {})
    lib.pagoda_issue_rates_loop.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.pagoda_issue_rates_loop.restype = ctypes.c_double
    lib.pagoda_issue_rates_omp.argtypes = [ctypes.c_int64, ctypes.c_int64]
    lib.pagoda_issue_rates_omp.restype = ctypes.c_double
    lib.pagoda_issue_rates_clock.argtypes = [ctypes.c_int64]
    lib.pagoda_issue_rates_clock.restype = ctypes.c_double
    sink = ctypes.c_float()

    def loop(mix: int) -> float:
        return statistics.median(lib.pagoda_issue_rates_loop(mix, args.steps, ctypes.byref(sink))
                                 for _ in range(args.repeats))

    out: dict[str, object] = {}
    if lib.pagoda_issue_rates_built():
        dp, fma = loop(0), loop(1)
        out["vpdpbusd_per_s"] = round(12 * args.steps / dp / 1e9, 3)
        out["fma_per_s"] = round(12 * args.steps / fma / 1e9, 3)
        # the time of one vpdpbusd at the measured rate, taken as one cycle: it issues once a cycle where the rate
        # matches add_chain_ghz (the Zen 4 machine: 3.63-3.66 G/s against 3.50-3.67 GHz)
        cycle = dp / (12 * args.steps)
        out["cycles_per_8_vpdpbusd"] = {name: round(loop(mix) / args.steps / cycle, 2) for mix, name in MIXES.items()}
    else:
        out["vpdpbusd_per_s"] = None  # no AVX-512 VNNI in this build
    clock = statistics.median(lib.pagoda_issue_rates_clock(args.steps) for _ in range(args.repeats))
    out["add_chain_ghz"] = round(args.steps / clock / 1e9, 3) if clock > 0 else None
    for key, regions in (("omp_region_us", 1), ("omp_barrier_us", 0)):
        seconds = statistics.median(lib.pagoda_issue_rates_omp(regions, args.omp_steps) for _ in range(args.repeats))
        out[key] = round(seconds / args.omp_steps * 1e6, 3)
    print(json.dumps(out | {"machine": machine_info()}))


if __name__ == "__main__":
    main()
