"""Adapters that let other training frameworks use mx_recipe's MX layers (optional extras)."""
