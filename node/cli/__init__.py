"""The ``gossipd`` command: parses arguments and hands each subcommand to its room. The one
place that may import everything, the coordinator's server included.
"""
