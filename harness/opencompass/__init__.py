"""OpenCompass on the harness's engines: ``python -m harness.opencompass`` (docs/opencompass.md).

Runs only inside ``.venv-opencompass`` (``.ci/opencompass_lane.sh``): OpenCompass pins numpy < 2,
datasets < 4 and scikit-learn 1.5, which the main venv does not share. Nothing here is imported by the rest
of the harness.
"""
