"""The ``dsv4-serve`` command: ``main`` dispatches; one module per subcommand.

Each subcommand module exposes ``add_arguments(parser)`` and ``main(args) -> int`` and is
imported only when chosen (``main.SUBCOMMANDS``). The top floor: it may import anything
below it; nothing imports it.
"""
