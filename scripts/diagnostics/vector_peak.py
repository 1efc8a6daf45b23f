"""The CPU's own ceiling for the kernels' arithmetic: 512-bit `vpdpbusd` (64 int8 multiply-adds each) and
512-bit fused multiply-adds (16 float32 each) a second, per core, with the operands in registers.

A small C++ loop (twelve independent accumulators, so the count is the units' throughput, not their
latency) is built with the kernels' compiler and `-march=native`, then run once alone and once on every
core at the same time; a dependent chain of integer adds gives the clock. docs/benchmarks.md ("The
CPU's own kernels") quotes:

    python scripts/diagnostics/vector_peak.py

On a host without AVX-512 VNNI the AVX2 products' instructions instead: 256-bit `vpmaddubsw` (32 byte
products, pairs added), fused multiply-adds (8 float32), and the two interleaved one for one (seven
accumulators each: apart, at most 7/3 and 7/4 a cycle by their latencies), which shows whether they
run on the same units (docs/benchmarks.md, "An AVX2-only host").
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

from specserve.runtime import cpu_kernels
from specserve.settings import cpu_has_vnni

SOURCE = r"""
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#define TWELVE(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
static double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
int main() {
  const long n = 100000000;
  __m512i b = _mm512_set1_epi32(0x01020304), c = _mm512_set1_epi32(0x05060708);
#define DECLARE_I(i) __m512i a##i = _mm512_set1_epi32(i);
  TWELVE(DECLARE_I)
  auto t0 = std::chrono::steady_clock::now();
  for (long k = 0; k < n; ++k) {
#define DOT(i) a##i = _mm512_dpbusd_epi32(a##i, b, c);
    TWELVE(DOT)
    asm volatile("" : "+v"(b));  // keeps the loop from being folded away
  }
  const double dot_s = seconds_since(t0);
  __m512i isum = _mm512_setzero_si512();
#define ADD_I(i) isum = _mm512_add_epi32(isum, a##i);
  TWELVE(ADD_I)
  __m512 x = _mm512_set1_ps(0.5f), y = _mm512_set1_ps(0.25f);
#define DECLARE_F(i) __m512 f##i = _mm512_set1_ps(i);
  TWELVE(DECLARE_F)
  t0 = std::chrono::steady_clock::now();
  for (long k = 0; k < n; ++k) {
#define FMA(i) f##i = _mm512_fmadd_ps(f##i, x, y);
    TWELVE(FMA)
    asm volatile("" : "+v"(x));
  }
  const double fma_s = seconds_since(t0);
  __m512 fsum = _mm512_setzero_ps();
#define ADD_F(i) fsum = _mm512_add_ps(fsum, f##i);
  TWELVE(ADD_F)
  long v = 0;
  const long adds = 2000000000L;
  t0 = std::chrono::steady_clock::now();
  for (long k = 0; k < adds; ++k) asm volatile("add $1, %0" : "+r"(v));
  const double add_s = seconds_since(t0);
  printf("%.4f %.4f %.4f %d %f\n", n * 12 / dot_s / 1e9, n * 12 / fma_s / 1e9, adds / add_s / 1e9,
         _mm512_reduce_add_epi32(isum), _mm512_reduce_add_ps(fsum));
}
"""


AVX2_SOURCE = r"""
#include <chrono>
#include <cstdio>
// Written in assembly so that every accumulator stays in one of AVX2's 16 registers (a compiler spilled
// some of the interleaved loop's 14 to memory): ymm15 is the shared operand, zero, so nothing overflows.
#define OP(op, i) op " %%ymm15, %%ymm" #i ", %%ymm" #i "\n"
#define TWELVE(op) OP(op, 0) OP(op, 1) OP(op, 2) OP(op, 3) OP(op, 4) OP(op, 5) OP(op, 6) OP(op, 7) \
  OP(op, 8) OP(op, 9) OP(op, 10) OP(op, 11)
#define BOTH OP("vpmaddubsw", 0) OP("vfmadd231ps", 7) OP("vpmaddubsw", 1) OP("vfmadd231ps", 8) \
  OP("vpmaddubsw", 2) OP("vfmadd231ps", 9) OP("vpmaddubsw", 3) OP("vfmadd231ps", 10) \
  OP("vpmaddubsw", 4) OP("vfmadd231ps", 11) OP("vpmaddubsw", 5) OP("vfmadd231ps", 12) \
  OP("vpmaddubsw", 6) OP("vfmadd231ps", 13)
#define TIMED(body) [](long n) { \
    const auto t0 = std::chrono::steady_clock::now(); \
    asm volatile("vpxor %%ymm15, %%ymm15, %%ymm15\n1:\n" body "dec %0\njnz 1b\n" : "+r"(n) : : \
                 "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", \
                 "xmm11", "xmm12", "xmm13", "xmm14", "xmm15"); \
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); }
int main() {
  const long n = 100000000;
  const double product_s = TIMED(TWELVE("vpmaddubsw"))(n);
  const double fma_s = TIMED(TWELVE("vfmadd231ps"))(n);
  const double both_s = TIMED(BOTH)(n);
  long v = 0;
  const long adds = 2000000000L;
  const auto t0 = std::chrono::steady_clock::now();
  for (long k = 0; k < adds; ++k) asm volatile("add $1, %0" : "+r"(v));
  const double add_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  printf("%.4f %.4f %.4f %.4f\n", n * 12 / product_s / 1e9, n * 12 / fma_s / 1e9, n * 14 / both_s / 1e9,
         adds / add_s / 1e9);
}
"""


def build(directory: Path, source_text: str = SOURCE) -> Path:
    compiler = cpu_kernels._compiler()  # the one the kernels are built with
    if compiler is None:
        raise SystemExit("no C++ compiler")
    source, binary = directory / "vector_peak.cpp", directory / "vector_peak"
    source.write_text(source_text)
    subprocess.run([compiler, "-O2", "-march=native", str(source), "-o", str(binary)], check=True)
    return binary


def run_at_once(binary: Path, runs: int) -> list[list[str]]:
    """The binary's printed figures, `runs` copies started together."""
    processes = [subprocess.Popen([str(binary)], stdout=subprocess.PIPE, text=True) for _ in range(runs)]
    return [process.communicate()[0].split() for process in processes]


def avx2(directory: Path, cores: int) -> None:
    binary = build(directory, AVX2_SOURCE)
    for runs in (1, cores):
        for index, (product, fma, both, clock, *_) in enumerate(run_at_once(binary, runs)):
            ghz = float(clock)
            print(
                f"{runs} at once, #{index}: vpmaddubsw ymm {float(product) / ghz:.2f} a cycle, "
                f"fma ymm {float(fma) / ghz:.2f} a cycle, the two interleaved {float(both) / ghz:.2f} "
                f"a cycle in all, clock {ghz:.2f} GHz"
            )


def main() -> None:
    with tempfile.TemporaryDirectory() as directory:
        cores = len(os.sched_getaffinity(0))
        if not cpu_has_vnni():
            print("no AVX-512 VNNI: the AVX2 products' instructions")
            avx2(Path(directory), cores)
            return
        binary = build(Path(directory))
        for runs in (1, cores):
            for index, (dot, fma, clock, *_) in enumerate(run_at_once(binary, runs)):
                dot_rate, fma_rate, ghz = float(dot), float(fma), float(clock)
                print(
                    f"{runs} at once, #{index}: vpdpbusd zmm {dot_rate:.2f} G/s "
                    f"({dot_rate / ghz:.2f} a cycle, "
                    f"{dot_rate * 64:.0f} G int8 multiply-adds), fma zmm {fma_rate:.2f} G/s "
                    f"({fma_rate / ghz:.2f} a cycle), clock {ghz:.2f} GHz"
                )


if __name__ == "__main__":
    main()
