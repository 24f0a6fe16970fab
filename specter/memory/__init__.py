"""Where experts live and how they move: the host store (``store``) or the checkpoint on disk
(``disk``, ``disk_store``), the device cache of expert slots (``cache``, ``stats``, ``budget``),
the link contract and the built-in links that copy bytes into the slots (``link``, ``links``),
and the prefetch scheduler that feeds the cache from a predictor's proposals (``scheduler``).
Below the decoders; above the model layout and the cache policies. (Not named ``offload``: that
name is the public ``specter.offload(model)``.)"""
