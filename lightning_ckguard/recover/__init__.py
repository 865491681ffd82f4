"""Recover: what a rejection does (a pure decision), and the in-place rewind to the last published checkpoint."""
