"""The fncall backend: stateless code runs on warm worker sandboxes."""
