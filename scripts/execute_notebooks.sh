#!/usr/bin/env bash
# Re-execute the committed notebooks in place with their default parameters, so the outputs that
# nbval compares (cells marked NBVAL_CHECK_OUTPUT) are current. Run after changing a notebook or
# anything that changes the seed-determined numbers; commit the result.
set -euo pipefail
cd "$(dirname "$0")/.."
source .venv/bin/activate
[ -n "${MINIWOB_CHROME_BINARY:-}" ] || eval "$(python -m arpo_lib.envs.miniwob.browser)"  # the browser and its driver
# The seed-determined numbers depend on the browser's rendering (the tiny model sees screenshots)
# and on the host's floating-point kernels: name both, so nbval compares the numbers only where
# they were recorded under the same (tests/test_notebooks.py).
{ "$MINIWOB_CHROME_BINARY" --version
  python -c "from arpo_lib.run.seeding import numerics_fingerprint; print(numerics_fingerprint())"
} > notebooks/RECORDED_WITH
# Arguments: the notebooks to re-execute (default: all of them).
[ $# -gt 0 ] && notebooks=("$@") || notebooks=(notebooks/*.ipynb)
for nb in "${notebooks[@]}"; do
  echo "executing $nb"
  start=$SECONDS
  # Widget state is not stored: it would embed every progress bar and viewer frame (hundreds of
  # KB); the static figures next to the widgets carry the pictures.
  jupyter nbconvert --to notebook --execute --inplace --ExecutePreprocessor.timeout=1800 \
    --ExecutePreprocessor.store_widget_state=False "$nb"
  echo "  $nb: $((SECONDS - start)) s"
done
