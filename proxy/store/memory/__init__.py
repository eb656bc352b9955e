"""The ``memory`` backend: the transcript tree in this process, bounded by bytes, LRU-evicted."""
