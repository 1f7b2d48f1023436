"""Adapters that let other serving stacks use kvtier_async tiers (each imports its stack lazily)."""
