"""An emulated Kubernetes API server for tests (see ``tests.kube.emulator``)."""
