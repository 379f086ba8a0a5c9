"""Declarative fleet policies: the pydantic models behind ``policies/*.yaml`` and their loader.

A policy file holds any of the sections ``models`` (``models``, ``generation``), ``tenants``
(``tenants``), ``rollout`` (``rollout``) and ``monitoring`` (``monitoring``), each a mapping
name -> spec, and the one-per-fleet sections ``gateway`` and ``runtime`` (``budgets``).
Sections merge across files (``loader``). Every problem is reported as ``<file>: <key.path>:
got <value> — expected <what>``, all of them in one ``ConfigError`` (one problem per line), so
a bad file is fixed in one pass.
"""
