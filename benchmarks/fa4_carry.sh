#!/usr/bin/env bash
# FlashAttention-4 for the device machine, which cannot download: its nvidia-cutlass-dsl-libs-cu13 wheel (92 MB) is
# larger than what one device call carries (64 MiB for the whole tree), so it travels in two calls to one warm
# machine (a machine is given back after 30 s idle: make the second call right after the first).
#   here:      bash benchmarks/fa4_carry.sh                # fills .fa4a/ and .fa4b/ (git-ignored)
#   call 1:    carry [".fa4a"], command: mkdir -p /tmp/fa4 && cp .fa4a/* /tmp/fa4/
#   call 2:    carry [".fa4b", ".whl"], command starting with `bash benchmarks/fa4_install.sh`, which does:
#              cp .fa4b/* /tmp/fa4/ && cat /tmp/fa4/part_* > /tmp/fa4/nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl \
#              && rm /tmp/fa4/part_* && python3 -m pip install -q --no-index --no-deps --target /tmp/site /tmp/fa4/*.whl .whl/*.whl \
#              && export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD
# (the DSL's packages sit under nvidia_cutlass_dsl/dsl_packages and are found through a .pth file, which a --target
# install does not run; `cutlass.cute` itself is in nvidia-cutlass-dsl-libs-core, which session 3 lacked)
set -euo pipefail
dl=$(mktemp -d)
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform any)
python3 -m pip download -q --no-deps --pre "${plat[@]}" -d "$dl" "flash-attn-4==4.0.0b36" "nvidia-cutlass-dsl==4.8.1" \
  "nvidia-cutlass-dsl-libs-base==4.8.1" "nvidia-cutlass-dsl-libs-core==4.8.1" "nvidia-cutlass-dsl-libs-cu13==4.8.1" "apache-tvm-ffi<0.2,>=0.1.11" \
  "torch-c-dlpack-ext" "quack-kernels>=0.5.3"
rm -rf .fa4a .fa4b && mkdir -p .fa4a .fa4b
for d in /.fa4a/ /.fa4b/; do grep -qxF "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude; done
big=$(ls "$dl"/nvidia_cutlass_dsl_libs_cu13-*.whl)
split -b 46000000 "$big" .fa4a/part_ && mv .fa4a/part_ab .fa4b/ && rm "$big"
mv "$dl"/*.whl .fa4a/  # the small wheels ride with the first half: the second call also carries .whl
du -sh .fa4a .fa4b
