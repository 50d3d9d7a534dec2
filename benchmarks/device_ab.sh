#!/bin/bash
# The GPU test machine's A/B of this tree against a base tree, in one device call (~8 minutes): both built with
# engine_bench, software prefetches counted per function of amx.cpp as that machine's compiler builds it, decode with the
# formats called in turn for both builds, the AMX and avx512_bf16 parity files, Layer Q T=2048 (BF16, FP8, INT4) per
# phase for both, and this tree against kt-kernel 0.7.2 in three rounds. Prepared on the dev machine first:
#   mkdir -p .dev/base && git archive <base> csrc benchmarks CMakeLists.txt pyproject.toml | tar -x -C .dev/base
#   .dev/ktk312: kt-kernel 0.7.2's cp312 wheel unzipped (kt_kernel/ without its avx2/avx512_base/vbmi/vnni
#   extensions, kt_kernel.libs/, and gguf/ from the gguf wheel), ~22 MB (BENCHMARKS.md, "What ran on the GPU
#   test machine")
# then run there with carry [".dev"]:  bash benchmarks/device_ab.sh 2>&1 | tee $OUT/ab.log
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
gcc --version | head -1
lscpu | grep -E "Model name|^CPU\(s\)"
FL="-O3 -std=gnu++17 -mavx2 -mfma -mf16c -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512bf16 -mamx-tile -mamx-bf16"
for d in .dev/base .; do
  echo "== prefetches per function of amx.cpp, $d"
  c++ -I$d/csrc/kernels -I$d/csrc $FL -S $d/csrc/kernels/amx.cpp -o - |
    awk '/^_Z.*:$/{name=$0} /prefetcht/{c[name]++} END{for(n in c) print c[n], n}' | sed 's/:$//' |
    while read -r n s; do echo "$n $(echo "$s" | c++filt | cut -c1-150)"; done
done
B="-G Ninja -DCMAKE_BUILD_TYPE=Release -Dpybind11_DIR=$(python3 -m pybind11 --cmakedir) -DKT_SFT_ENGINE_BENCH=ON"
(cmake -S .dev/base -B build/base $B > /dev/null && ninja -C build/base -j8 > /dev/null && echo base built) &
(cmake -S . -B build/new $B > /dev/null && ninja -C build/new -j8 > /dev/null && echo new built) &
wait
for b in base new; do  # the Python package of each build, for bench_layer
  rm -rf .dev/pk_$b && mkdir -p .dev/pk_$b && cp -r kt_sft .dev/pk_$b/ && rm -f .dev/pk_$b/kt_sft/_C*.so
  cp build/$b/_C*.so .dev/pk_$b/kt_sft/
done
cp build/new/_C*.so kt_sft/
for r in 1 2; do
  for b in base new; do echo "== decode, $b: $(timeout 60 build/$b/engine_bench 15 bf16,int4,fp8 1 Q 2>&1 | tail -1)"; done
done
OMP_NUM_THREADS=1 KT_SFT_THREADS=1 timeout 200 python3 -m pytest -q -n 15 -k "amx or avx512_bf16" \
  tests/unit/test_experts_parity.py tests/unit/test_quantized_parity.py tests/unit/test_lora_dropout.py \
  tests/unit/test_engine_behaviour.py 2>&1 | tail -2
for b in base new; do
  echo "== Layer Q T=2048, $b"
  PYTHONPATH=.dev/pk_$b timeout 100 python3 benchmarks/bench_layer.py --shape Q --T 2048 --threads 15 \
    --formats bf16,fp8,int4 --skip torch,peer,rss,decode,peak --reps 3 --phases 2>&1 | sed -n "/^shape/,\$p" | grep -v "^$"
done
echo "== this tree against kt-kernel"
PYTHONPATH=$PWD:$PWD/.dev/ktk312 timeout 200 python3 benchmarks/bench_layer.py --shape Q --T 2048 --threads 15 \
  --rounds 3 --reps 3 --skip torch,rss,decode,peak 2>&1 | tail -25
