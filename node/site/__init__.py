"""One site's daemon put together from the trainer and network rooms: start-up checks, the
trainer thread and the event loop side by side, shutdown, the library API for a user's own
training loop. Runs in the daemon's main thread.

May import every room below it and the coordinator's client; never a launcher, the CLI or
the coordinator's server.
"""
