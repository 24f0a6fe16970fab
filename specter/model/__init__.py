"""The model: loading a checkpoint and tokenizer (``loader``) and finding its routed experts
(``layout``), whatever the architecture."""
