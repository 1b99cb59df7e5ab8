"""Specula: speculative-decoding LLM deployments on Kubernetes, kept tuned."""
__version__ = "0.1.0"
