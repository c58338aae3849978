"""What runs on every host: boot, data, model, train, checkpoint, artifacts."""
