#!/usr/bin/env bash
# Builds the Python package (python/, the native module crates/app/farmap-python) into a venv
# and runs its tests (python/tests, pytest). scripts/test.sh runs it after `cargo test`; alone:
#
#     scripts/test-python.sh [PYTEST ARGS...]
#
# The venv lives in the cargo target directory ($CARGO_TARGET_DIR/python-venv) and is made
# with Debian's /usr/bin/python3, not whatever `python3` comes first on PATH (a pyenv shim on
# developer machines): one interpreter for the venv, the module and the crate's unit tests,
# whose libpython .cargo/config.toml names. The package is installed as docs/python.md says
# (`pip install ./python`), with two changes that keep the suite fast: the dev profile (the
# dependencies `cargo test` built are reused: only the module itself and pyo3 compile) and no
# build isolation (maturin comes from the venv instead of a fresh download per run).
#
# The last line is pytest's own summary ("N passed, N skipped in S s").
set -euo pipefail
cd "$(dirname "$0")/.."
target_dir="${CARGO_TARGET_DIR:-target}"
mkdir -p "$target_dir"
CARGO_TARGET_DIR=$(cd "$target_dir" && pwd) # absolute: maturin runs cargo from python/
export CARGO_TARGET_DIR
venv="$CARGO_TARGET_DIR/python-venv"
if [[ ! -x "$venv/bin/python" ]]; then
  /usr/bin/python3 -m venv "$venv"
fi
# As if activated: the build backend runs `maturin` from PATH.
export PATH="$venv/bin:$PATH" VIRTUAL_ENV="$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check "maturin>=1.9.4,<2" pytest numpy
MATURIN_PEP517_ARGS="--profile dev" "$venv/bin/python" -m pip install -q --disable-pip-version-check \
  --no-build-isolation --no-deps --force-reinstall ./python
# From the repository's root: `import farmap` must find the installed package, not python/farmap
# (which has no native module).
"$venv/bin/python" -c 'import farmap, sys; print("farmap from", farmap.__file__, file=sys.stderr)'
exec "$venv/bin/python" -m pytest -q -rs -p no:cacheprovider python/tests "$@"
