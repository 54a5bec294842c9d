"""The dsec command line."""
