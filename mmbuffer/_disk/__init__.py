"""The files of one store directory: format, manifest, locks, raw and compressed columns."""
