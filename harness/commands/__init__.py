"""One module per `ring-harness` subcommand: each has `add_arguments(parser)` and `run(args) ->
int`."""
