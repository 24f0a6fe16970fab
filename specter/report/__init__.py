"""What a run measured: per-generation metrics (``metrics``) and the ``specter.report/1`` schema
with its text rendering (``schema``)."""
