"""CogACT: Prismatic VLM + cognition feature -> DiT action model (microsoft/CogACT)."""
