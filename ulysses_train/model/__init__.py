"""The transformers model: presets and building, its buffers, and every patch the levers make to it."""
