"""The discrete-event simulator: every role's pure core on a virtual clock (``zserve sim``)."""
