"""Test-only machinery: fault injection and wire recording. Never imported on the production path."""
