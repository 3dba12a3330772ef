"""The agent on each GPU host: claims jobs over HTTP, runs torchrun, supervises it.

It never opens the database and never imports ``service``: everything it does
goes through the API with the worker token.
"""
