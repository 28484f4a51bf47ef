# Sourced by phase_a.sh and phase_b.sh on the device machine: the carried wheels installed once into /tmp/site
# (it outlives a call; the carried .whl folder does not), and the checkout importable without installing it.
export PYTHONUNBUFFERED=1
ls /tmp/site/transformers >/dev/null 2>&1 ||
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl ||
    exit 1
export PYTHONPATH=/tmp/site:$PWD
