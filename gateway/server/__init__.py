"""The HTTP server: routes, streams, job stores, auth, the OpenAI routes and the API documents."""
