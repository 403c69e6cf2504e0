"""What every reader and exporter shares: the write, read-back, walk and destination steps."""
