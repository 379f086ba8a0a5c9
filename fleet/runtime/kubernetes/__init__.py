"""The Kubernetes runtime: the runtime itself (``runtime``), what it writes (``manifests``) and
the API it writes through (``api``)."""
