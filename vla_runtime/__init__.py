"""vla-runtime: real-time inference runtime for vision-language-action policies."""
