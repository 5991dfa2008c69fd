"""Incremental detokenization, stop strings, fan-out to gateways (services issue)."""
