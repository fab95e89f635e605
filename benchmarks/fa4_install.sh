#!/usr/bin/env bash
# On the device machine, in the call after the one that parked FA4's first half in /tmp/fa4 (benchmarks/fa4_carry.sh
# says how the halves travel): joins the DSL wheel and installs FA4 with the carried .whl/ into /tmp/site. Without
# the first half (a fresh machine: the parking call went to another one) it installs .whl/ alone, and the runs after
# it use cuDNN. Then: export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD
set -u
pip_install() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$@"; }
cp .fa4b/* /tmp/fa4/ && cat /tmp/fa4/part_* > /tmp/fa4/nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl \
  && rm /tmp/fa4/part_*
pip_install /tmp/fa4/*.whl .whl/*.whl || pip_install .whl/*.whl
