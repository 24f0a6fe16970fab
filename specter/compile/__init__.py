"""torch.compile'd decoding steps: static KV buffers, experts read through the cache's device slot
table (``decoder``), over the model math of ``decoder_math`` (DeepSeek's parts in ``deepseek_math``)
reading what ``model_weights`` reads from a model; the same math runs the eager draft's
one-token step (``lean_draft``)."""
