"""DLPack views and the vLLM attention backend (the only code that imports torch or vLLM).

Not built yet: see the project's issues.
"""
