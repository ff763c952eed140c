"""What measures HiSparse (nothing in a decode step imports it): generated
workloads, the quality evaluation, selection traces and their simulator, the
attention, kernel and generation benchmarks, and the demos. (The serving load
generator is a command of its own: `cli/bench_serve.py`.)"""
