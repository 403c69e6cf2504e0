"""One reader per source format."""
