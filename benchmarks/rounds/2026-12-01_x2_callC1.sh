#!/usr/bin/env bash
# Session 4 (2026-12-01), call C1 on a fresh nvidia-h200-x2: only parks FA4's first half (.fa4a) on the machine for
# call C2 (and again, as call D1, for D2), which must follow within 30 s (one call carries at most 64 MiB; FA4's DSL wheel alone is 92 MB).
mkdir -p /tmp/fa4 && cp .fa4a/* /tmp/fa4/ && ls /tmp/fa4 | wc -l
