"""The Python client's former place: it is `gateway.client` now (this name stays for one release)."""

from gateway.client import (  # noqa: F401
    AsyncClient,
    Client,
    ClientError,
    HttpError,
    JobError,
    Outcome,
    StreamEndedError,
    StreamEvent,
)
