"""The control plane: routes, authentication and tenancy, placement over the edges (`dsec apiserver`)."""
