"""serving-fleet: the core library every part of the fleet imports."""

__version__ = "0.1.0"
