"""The node agent."""

from dsec.edge.edge import Edge, Sandbox

__all__ = ["Edge", "Sandbox"]
