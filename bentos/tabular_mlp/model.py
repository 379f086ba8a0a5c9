"""The network, its config file, and loading for inference (CUDA when present, else CPU)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

CONFIG = "config.json"
WEIGHTS = "model.pt"


class MLP(nn.Module):
    def __init__(self, inputs: int, hidden: list[int], classes: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = inputs
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Predictor:
    """Normalises inputs with the training statistics and returns class probabilities."""

    def __init__(self, folder: str | Path, device: str | None = None, quantize: bool = False) -> None:
        folder = Path(folder)
        self.config: dict[str, Any] = json.loads((folder / CONFIG).read_text())
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        net = MLP(self.config["inputs"], self.config["hidden"], self.config["classes"])
        net.load_state_dict(torch.load(folder / WEIGHTS, map_location="cpu", weights_only=True))
        net.eval()
        if quantize:
            if self.device.type != "cpu":
                raise ValueError("int8 dynamic quantization runs on the CPU only")
            net = torch.ao.quantization.quantize_dynamic(net, {nn.Linear}, dtype=torch.qint8)
        self.net = net.to(self.device)
        self.faults: dict[str, float] = self.config.get("faults", {})
        self.mean = torch.tensor(self.config["mean"], dtype=torch.float32, device=self.device)
        self.std = torch.tensor(self.config["std"], dtype=torch.float32, device=self.device)

    @torch.inference_mode()
    def predict_proba(self, features: np.ndarray) -> np.ndarray:
        x = torch.as_tensor(np.asarray(features, dtype=np.float32), device=self.device)
        logits = self.net((x - self.mean) / self.std)
        return torch.softmax(logits, dim=1).float().cpu().numpy()


def save(folder: Path, net: MLP, config: dict[str, Any]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(net.state_dict(), folder / WEIGHTS)
    (folder / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
