"""Routes: the pure route table and version choice (``table``), its audited store
(``store``) and the one rollback (``rollback``)."""
