"""Helpers the tests share (imported by test modules; never tests themselves)."""
