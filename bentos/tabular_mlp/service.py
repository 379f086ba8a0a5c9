"""BentoML service for one tabular-mlp model version.

A thin shell: resources, traffic and batching come from ``fleet_build.json``, which
``fleet package`` writes into the build from the model's policy; the model is the
checksum-verified artifact imported into BentoML's model store as ``<model>:<version>``.

The model's files are checked against the manifest's listing (``fleet_build.json``
``files``) when this module is imported, so a mismatch stops ``bentoml serve`` before any
worker starts (BentoML would otherwise respawn a failing worker forever), and again in
``__init__`` right before the weights load (unchanged files are not hashed twice).
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import bentoml
import numpy as np

from integrity import verify_folder  # noqa: I001 - the Bento holds these files at its root
from model import Predictor

BUILD = json.loads((Path(__file__).with_name("fleet_build.json")).read_text())
MODEL = bentoml.models.BentoModel(BUILD["bento_model"])
REMEDY = (f"expected the files of {BUILD['model']}:{BUILD['version']} as registered; on a fleet machine "
          f"`fleet package {BUILD['model']} {BUILD['version']} --force` imports them again from the registry")  # fmt: skip


def verify_model(path: str) -> None:
    """Raise ``integrity.ArtifactMismatch`` unless every file of the manifest is in ``path`` with its registered bytes."""
    verify_folder(path, BUILD["files"], BUILD["artifact_sha256"], remedy=REMEDY)


verify_model(MODEL.resolve().path)


@bentoml.service(
    name=BUILD["service_name"],
    resources=BUILD["resources"],
    traffic=BUILD["traffic"],
)
class TabularClassifier:
    model_ref = MODEL

    def __init__(self) -> None:
        verify_model(self.model_ref.path)
        self.predictor = Predictor(self.model_ref.path, quantize=BUILD["quantize"])
        self.faults = self.predictor.faults  # built into a version on purpose, to rehearse rollbacks

    @bentoml.api(
        batchable=BUILD["batching"]["batchable"],
        batch_dim=0,
        max_batch_size=BUILD["batching"]["max_batch_size"],
        max_latency_ms=BUILD["batching"]["max_latency_ms"],
    )
    def predict(self, features: np.ndarray) -> np.ndarray:
        """features [n, 4] float32 → class probabilities [n, 2]."""
        if self.faults:
            time.sleep(self.faults.get("latency_ms", 0.0) / 1000)
            if random.random() < self.faults.get("error_rate", 0.0):
                raise RuntimeError("fault built into this version: a share of requests fails")
        return self.predictor.predict_proba(features)

    @bentoml.api
    def metadata(self) -> dict:
        return {k: BUILD[k] for k in ("model", "version", "artifact_sha256", "quantize")} | {
            "device": str(self.predictor.device), "faults": self.faults,
        }
