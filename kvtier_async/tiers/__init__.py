"""Built-in secondary tiers. Each module is imported only when a config names its type."""
