"""Mixture-of-experts: routers' load-balancing loss over the global batch, and what a model's
routers tell meshtrain (meshtrain's own MoE layers and Hugging Face MoE models alike)."""

from meshtrain.moe.balance import RouterStats, balance_term, router_stats

__all__ = ["RouterStats", "balance_term", "router_stats"]
