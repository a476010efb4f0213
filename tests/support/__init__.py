"""Code the tests use: user-side compressors, policies and helpers."""
