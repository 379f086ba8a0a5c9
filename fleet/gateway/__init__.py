"""The data plane: a multi-tenant Open Inference Protocol gateway in front of model services."""

from fleet.gateway.app import Settings, create_app
from fleet.gateway.view import FleetView

__all__ = ["FleetView", "Settings", "create_app"]
