"""Local meshes of real daemon processes on one machine (`mesh up`, `demo`): their configs,
processes, progress, plots and an in-process MQTT broker. Runs in the launcher's process,
never inside a daemon.

May import every node room but the CLI; never the coordinator's server.
"""
