"""Training jobs: what one node trains, on which shard, from which initial model.

The built-in jobs (``synthetic``, ``digits``, ``mnist1d``, ``shakespeare``), a job's
spec and its checks, their models and data, and a plugin's loading
(:func:`.registry.build_job`). May import the errors only: a job knows nothing of gossip.
"""
