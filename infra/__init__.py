"""The Pulumi program of the serving fleet: ``__main__.py`` wires the components of this package."""
