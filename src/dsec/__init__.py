"""dsec: elastic sandboxes for agentic RL."""

from dsec.errors import DsecError

__version__ = "0.1.0"

from dsec.client import AsyncClient, AsyncSandbox, Client, Sandbox

__all__ = ["AsyncClient", "AsyncSandbox", "Client", "DsecError", "Sandbox", "__version__"]
