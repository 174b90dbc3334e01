"""The HTTP server: routes, admission, streams, job stores, auth, the OpenAI routes and the API documents."""
