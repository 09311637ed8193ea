"""The controller's processes, composed: ``opsd serve`` (the API, the detection pass, a backend from the registry)
and ``opsd run`` (with the local backend, supervising one run). The one layer that puts the API on a server beside
the controller and a backend: the API and the backends below it know nothing of processes."""
