"""fncall: stateless code runs on warm worker sandboxes. This package holds the parts that are
neither edge nor apiserver: the runner that lives inside each worker sandbox (runner.py) and
the choice of a call's project from its caller (tenancy.py). The edge's pool of workers is
dsec.edge.fncall."""
