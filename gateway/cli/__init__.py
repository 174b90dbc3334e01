"""The `streamgate` command (commands.py) and the Python client (client.py): the top floor, over the server and the backends."""
