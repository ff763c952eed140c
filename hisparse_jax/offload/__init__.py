"""Offload mode: cold pages in host memory (`store`) and the residency policy
that chooses which stay on the device (`policy`)."""
