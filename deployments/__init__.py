"""HTTP and Ray Serve: the OpenAI-compatible ingress and the application builder."""
