"""Real models decoding through HiSparse: the Llama family in Flax NNX.

    from hisparse_jax.models import load, generate
    model, tok = load("smollm2-135m")        # fetched once into $HISPARSE_HOME
    gen = generate(model, tok, "Write a haiku about the sea.", chat=True)
    print(gen.run().text, gen.summary.line())

`load` takes a registered name (`registry.MODELS`), a .gguf file or an HF
checkpoint folder. `Engine` is the lower level: slots, `prefill(slot, ids)`,
`decode_step(active)`. The cache library never imports this package.
"""

from hisparse_jax.models.engine import Engine
from hisparse_jax.models.generate import Generation, Summary, generate, generate_batch
from hisparse_jax.models.llama import Llama, LlamaConfig, RopeScaling
from hisparse_jax.models.registry import MODELS, fetch, load, resolve
from hisparse_jax.models.sampling import SamplingParams
from hisparse_jax.models.tokenizer import Tokenizer

__all__ = [
           "MODELS",
           "Engine",
           "Generation",
           "Llama",
           "LlamaConfig",
           "RopeScaling",
           "SamplingParams",
           "Summary",
           "Tokenizer",
           "fetch",
           "generate",
           "generate_batch",
           "load",
           "resolve",
]
