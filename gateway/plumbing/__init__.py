"""What every service of streamgate shares (the gateway and the executor): draining, logs, metrics, slow clients, send buffers."""
