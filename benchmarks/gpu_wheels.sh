#!/usr/bin/env bash
# The small packages the GPU check's trainer stage needs beyond a bare GPU machine's torch, transformers, numpy and
# tensorboard -- tyro and its two dependencies -- as wheels for that machine's Python 3.12 (x86-64), into
# benchmarks/wheels/ (ignored by git; well under the upload limit). Run it where a package registry is reachable,
# before sending the working tree to the GPU machine; benchmarks/gpu_trainer_check.py installs them from there.
set -euo pipefail
cd "$(dirname "$0")"
rm -rf wheels && mkdir wheels
python -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 --platform any --dest wheels tyro docstring-parser typeguard
ls -l wheels && du -sh wheels
