"""Tests of mfsdp2/optim/ (one folder's units; behaviour against FSDP2 is in tests/fsdp2_compat/)."""
