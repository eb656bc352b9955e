"""The ``sqlite`` backend: the memory store with write-behind persistence to one file."""
