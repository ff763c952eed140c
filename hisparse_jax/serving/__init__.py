"""Model serving over HiSparse: a continuous-batching scheduler (`scheduler.py`)
around one `Engine`, an OpenAI-compatible HTTP server (`app.py`, FastAPI +
uvicorn) with Prometheus metrics (`metrics.py`), `hisparse serve` (`cli.py`) and
`hisparse bench serve`, a load generator for any OpenAI-compatible server
(`bench.py`). The cache core never imports this package."""
