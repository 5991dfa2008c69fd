"""What every service shares: config, sampling params, proto stubs, prefix hashing, telemetry."""
