"""One exporter per target format."""
