"""Training, evaluation and tracking of the pretraining pipeline (docs/ARCHITECTURE: below `cluster`, above
`data_prep`).

MLflow 3 sends usage telemetry to its own servers unless told not to; the pipeline's users run on clusters
that are often offline and must not send anything they did not configure, so importing the pipeline turns
it off where the environment does not say otherwise (`MLFLOW_DISABLE_TELEMETRY=false` turns it back on).
Processes started from here (torchrun ranks, the MLflow server of a multi-node run) inherit the setting.
"""

import os

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
