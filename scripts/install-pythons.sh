#!/usr/bin/env bash
# Checks (and where missing, builds with pyenv) the CPython versions the Python frame tests
# read (node-agent/tests/python_stacks.rs; 3.7 is the version it does not read, to show the
# capture still succeeds) and whose headers scripts/python-offsets.sh
# compiles against. Idempotent: versions already installed are only checked (instant on
# the CI image, which has them). A missing version is built with --enable-shared, as the
# image's are: several minutes each on two cores.
#
#   scripts/install-pythons.sh
set -euo pipefail
# shellcheck source=scripts/env.sh
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"

# Keep in step with node-agent/tests/python_stacks.rs and scripts/python-offsets.sh.
VERSIONS=(3.7.16 3.8.18 3.9.18 3.10.13 3.11.7 3.12.1 3.13.0)
export PYENV_ROOT="${PYENV_ROOT:-/root/.pyenv}"
PYENV="$PYENV_ROOT/bin/pyenv"

for v in "${VERSIONS[@]}"; do
  minor="${v%.*}"
  if [[ -x "$PYENV_ROOT/versions/$v/bin/python$minor" && -d "$PYENV_ROOT/versions/$v/include/python$minor/internal" ]]; then
    echo "CPython $v: ok"
    continue
  fi
  if [[ ! -x "$PYENV" ]]; then
    echo "CPython $v is missing and pyenv is not installed at $PYENV: install pyenv (https://github.com/pyenv/pyenv), then run this again" >&2
    exit 1
  fi
  echo "CPython $v: building with pyenv (--enable-shared)"
  PYTHON_CONFIGURE_OPTS="--enable-shared" "$PYENV" install -s "$v"
done
