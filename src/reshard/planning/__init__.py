"""Planning: which source rank sends which box to which destination rank, in which round; pure data."""
