"""Test helpers for filechannel users."""
