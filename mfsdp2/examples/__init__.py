"""Example models and scripts for mfsdp2 (a small Llama-style decoder and a 2-rank CPU demo)."""
