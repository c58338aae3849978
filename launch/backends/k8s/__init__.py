"""The Kubernetes backend: JobSet rendering (`render.py`, no client needed), submission, status
and logs (`backend.py`) through the official client (`client.py`)."""
