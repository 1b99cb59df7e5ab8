"""The demo: a target and a draft model trained on real text, served with speculation."""
