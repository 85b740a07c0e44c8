"""Tests of mfsdp2/dtensors/ (one folder's units; behaviour against FSDP2 is in tests/fsdp2_compat/)."""
