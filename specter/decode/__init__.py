"""Decoding: the engines (``engine``: the base, resident and offloaded ones; ``speculative``;
``hf_offload``), the KV helpers (``kv``), sampling and acceptance rules, and the speculation
governors (``governors``, ``roofline``). Engines are built by ``specter.build`` from a recipe."""
