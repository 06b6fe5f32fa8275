"""Reading for a check: what to read, in which blocks, and the views the kernel compares."""
