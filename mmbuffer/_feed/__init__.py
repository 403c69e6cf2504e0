"""Into training: the prefetching stream, its threads, processes and pinned blocks, epochs."""
