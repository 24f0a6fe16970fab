"""The experts implementation Specter registers with transformers and the runtime behind it
(``runtime``): target layers computed from cache slots, draft layers from resident INT4 experts."""
