"""The node agent."""

from dsec.edge.edge import Edge
from dsec.edge.sandbox import Sandbox

__all__ = ["Edge", "Sandbox"]
