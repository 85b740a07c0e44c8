"""Model definitions (plain ``torch.nn``, nothing of mfsdp2): the Llama-style decoder the
examples, the memory estimate's command line, the tests and the benchmarks build on."""

MAY_IMPORT: tuple[str, ...] = ()
