"""Sandbox backends: how a sandbox is made, reached and torn down on this node."""
