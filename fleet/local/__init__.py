"""The local fleet: ``fleet up`` and the scripted ``fleet demo``."""
