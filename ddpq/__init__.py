"""ddpq: a queue and REST service for PyTorch distributed training jobs.

What users import: ``ddpq.train`` (inside a training program) and
``ddpq.client.Client`` (to submit and follow jobs from Python). Importing ddpq
loads neither the service nor the worker.
"""

__version__ = "0.1.0"
