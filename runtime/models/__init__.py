"""Model families. One Llama-style implementation covers Llama, Mistral, Qwen2 and Qwen3."""
