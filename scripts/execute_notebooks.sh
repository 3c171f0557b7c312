#!/usr/bin/env bash
# Re-execute the committed notebooks in place with their default parameters, so the outputs that
# nbval compares (cells marked NBVAL_CHECK_OUTPUT) are current. Run after changing a notebook or
# anything that changes the seed-determined numbers; commit the result.
set -euo pipefail
cd "$(dirname "$0")/.."
source .venv/bin/activate
for nb in notebooks/*.ipynb; do
  echo "executing $nb"
  # Widget state is not stored: it would embed every progress bar and viewer frame (hundreds of
  # KB); the static figures next to the widgets carry the pictures.
  jupyter nbconvert --to notebook --execute --inplace --ExecutePreprocessor.timeout=1800 \
    --ExecutePreprocessor.store_widget_state=False "$nb"
done
