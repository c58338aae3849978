"""Model families, their shared layers, the family registry, sharding rules and generation."""
