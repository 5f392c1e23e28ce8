"""LoRA adapters over a loaded model: PEFT folders read and checked (`adapter`), and the slots
that serve several of them in one batch (`slots`)."""
