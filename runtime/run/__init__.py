"""A run's storage: the artifact store, artifacts, checkpoints and their metadata, compatibility, inspection."""
