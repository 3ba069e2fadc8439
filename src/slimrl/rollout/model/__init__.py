"""The engine's view of a model: `views` (what to run, read live from the modules), `reference` (the plain math every
kernel is tested against), `llama` (the decoder's one forward)."""
