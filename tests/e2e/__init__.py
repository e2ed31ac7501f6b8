"""End-to-end tests: the system through the gateway, as a user would use it."""
