"""Model store (packaged SmolLM2 GGUF -> HF folder cache) and reasoning-gym tasks."""
