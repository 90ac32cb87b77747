"""Model definitions and checkpoint I/O."""
