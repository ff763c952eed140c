"""Model serving over HiSparse: continuous batching (`batcher.py`) around one
`Engine`, and an OpenAI-compatible HTTP server (`app.py`, FastAPI + uvicorn) with
Prometheus metrics (`metrics.py`). `hisparse serve` is `cli/serve.py`; the load
generator `hisparse bench serve` is `cli/bench_serve.py`. The cache core never
imports this package."""
