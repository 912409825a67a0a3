"""Readers and synthetic generators for the models' data."""
