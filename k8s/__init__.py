"""The Kubernetes backend: JobSet rendering, submission, status and logs via the official client."""
