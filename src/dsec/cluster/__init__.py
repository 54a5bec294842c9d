"""A cluster on one machine or many: PostgreSQL, a registry, apiservers and edges (issue #14)."""
