"""Framework adapters: lbbsp.integrations.torch, .keras and .flower (each imports its framework lazily)."""
