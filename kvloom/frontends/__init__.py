"""Frontends own text: tokenization, chat templates, detokenization, stop strings, validation."""
