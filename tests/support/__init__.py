"""What the tests share: processes they start, tiny models, tool modules the servers import, fault proxies."""
