"""zserve: Symphony-style deferred batch scheduling for DNN inference serving."""
