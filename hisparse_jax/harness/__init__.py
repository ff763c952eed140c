"""What measures HiSparse (nothing in a decode step imports it): generated
workloads, the quality evaluation, selection traces and their simulator, the
attention, kernel, generation and serving benchmarks, and the demos."""
