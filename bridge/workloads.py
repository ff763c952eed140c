"""Prompts for the bridge's engine checks (no vLLM import): models.md's passkey
retrieval prompt, and the short chat prompts the token-equality check uses."""

from __future__ import annotations

FILLER = ("The grass is green. The sky is blue. The sun is yellow. "
          "Here we go. There and back again.")
INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and "
         "memorize it. I will quiz you about the important information there.")
QUESTION = "What is the pass key? The pass key is"
# 297 filler lines make a prompt of about 7.5K tokens (7,493) with SmolLM2's tokenizer.
FILLERS_7K5 = 297


def passkey(n_filler: int, depth: float, key: int) -> str:
    """models.md's passkey prompt: raw completion, no chat template, no BOS; the
    needle after int(n_filler * depth) filler lines."""
    at = int(n_filler * depth)
    return "\n".join([INTRO] + [FILLER] * at
                     + [f"The pass key is {key}. Remember it. {key} is the pass key."]
                     + [FILLER] * (n_filler - at) + [QUESTION])


def passkey_hit(key: int, text: str) -> bool:
    """A hit: the 5-digit key in the first 8 generated tokens' text."""
    return str(key) in text


SYSTEM = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
          "Hugging Face<|im_end|>\n")
CHAT_QUESTIONS = [
    "Explain how photosynthesis works.",
    "Write a short story about a cat who learns to fly.",
    "Give me five tips for learning to code.",
    "What are the benefits of regular exercise?",
    "Describe the water cycle.",
    "Why is the sky blue?",
    "Write a haiku about the sea.",
    "How do I make a cup of tea?",
]


def chat(question: str) -> str:
    """SmolLM2's ChatML prompt (the default system prompt) for one user message."""
    return SYSTEM + f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
