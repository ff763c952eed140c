"""Prompts for the bridge's engine checks (no vLLM import): models.md's passkey
retrieval prompt, and the short chat prompts the token-equality check uses."""

from __future__ import annotations

from hisparse_jax.models.prompts import passkey, passkey_hit  # noqa: F401 (the bridge's tests use them)

# 297 filler lines make a prompt of about 7.5K tokens (7,493) with SmolLM2's tokenizer.
FILLERS_7K5 = 297


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
