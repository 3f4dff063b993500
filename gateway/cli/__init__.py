"""Commands: serve, the tenant and audit commands, the demo and the preflight checks."""
