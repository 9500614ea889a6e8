"""Multi-LoRA adapters: the PEFT adapter format."""

__all__: list[str] = []
