"""`python -m client bench`: the serving benchmark, measured the way `vllm bench serve` measures.

datasets (what to send) -> runner (when to send it, per-request timestamps) -> stats (pure metrics)
-> report (table, JSON) and plot (PNG).
"""
