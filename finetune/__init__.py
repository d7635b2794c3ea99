"""Fine-tuning of the KV-Efficient gating modules (peft LoRA on the LLM)."""
