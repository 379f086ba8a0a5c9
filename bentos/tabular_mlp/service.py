"""BentoML service for one tabular-mlp model version.

A thin shell: resources, traffic and batching come from ``fleet_build.json``, which
``fleet package`` writes into the build from the model's policy; the model is the
checksum-verified artifact imported into BentoML's model store as ``<model>:<version>``.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import bentoml
import numpy as np

from model import Predictor  # noqa: I001 - the Bento holds this folder's files at its root

BUILD = json.loads((Path(__file__).with_name("fleet_build.json")).read_text())


@bentoml.service(
    name=BUILD["service_name"],
    resources=BUILD["resources"],
    traffic=BUILD["traffic"],
)
class TabularClassifier:
    model_ref = bentoml.models.BentoModel(BUILD["bento_model"])

    def __init__(self) -> None:
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
