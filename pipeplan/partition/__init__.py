"""Cost model and dynamic program: stage cuts, replication, chunk placement, memory check."""
