#!/bin/sh
# A C compiler for AVX2 code on any x86-64 CPU: cc with -march=native taken as -march=haswell (AVX2, FMA, F16C;
# no AVX-512, no VNNI). With CC=benchmarks/cc_avx2.sh the engine builds its C kernels as an AVX2-only CPU would,
# under a library name of their own (the compiler is part of it), so an AVX-512 machine can time the AVX2 code:
#   CC=$PWD/benchmarks/cc_avx2.sh .venv/bin/python -m benchmarks.gguf_shapes --shape llama-3.2-1b --type Q8_0 --out /tmp/shapes --interleaved 2
for arg do
    shift
    [ "$arg" = "-march=native" ] && arg="-march=haswell"
    set -- "$@" "$arg"
done
exec cc "$@"
