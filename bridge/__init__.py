"""The only code that imports torch or vLLM: DLPack views (`dlpack`) and HiSparse as a
vLLM attention backend (`plugin` registers it; `vllm_backend`, `vllm_cpu`; the
engine-independent half is `runtime`). See docs/log/vllm.md."""
