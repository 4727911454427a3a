"""Test doubles for hardware this machine lacks: a fake accelerator device and a recording compile backend."""
