"""Tests of mfsdp2/frontend/ (one folder's units; behaviour against FSDP2 is in tests/fsdp2_compat/)."""
