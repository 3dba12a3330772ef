"""What of a job this host keeps on disk: its code (the content cache, the job's own
directory), the checkpoints the API lets go and the one a fork elsewhere wants, the
outputs an attempt leaves, each user's caches across their jobs, the worker's own data
directory.

It may import ``walled`` (a directory handed to a job's uid and taken back, a tree's
seal) and ``edges`` (the API); never ``starting`` nor ``executors``.
"""
