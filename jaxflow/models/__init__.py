"""Decoder-only transformer family (Llama, Qwen2, Qwen3 layouts) and its HF checkpoint I/O."""
