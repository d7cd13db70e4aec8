"""Applications on top of the library: the `reshard` command line, the demo, reports, simulation."""
