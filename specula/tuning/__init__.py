"""Pure tuning logic (acceptance estimation, cost model, goodput optimiser); no Kubernetes, no torch."""
