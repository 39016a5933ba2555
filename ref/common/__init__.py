"""The library every package shares (ref, fast, placement, scripts): configuration, weight formats and names,
checkpoint and artifact files, the tokenizer, sampling, errors and the CLI helpers. It holds no model semantics
(those are `ref`'s) and imports nothing from the rest of the project."""
