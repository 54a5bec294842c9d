"""HTTP plumbing shared by the apiserver and the edge server: the Gate (authentication before
any body, streaming body caps, express lanes), error handlers, SSE and the per-sandbox
routes both servers serve over the edge contract (`dsec.edgeapi`)."""
