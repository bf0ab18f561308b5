"""Model-side parts shared by every paper (backbones, the LM base module, evaluation)."""
