"""One module per subcommand; each defines `add_parser(subparsers)` that sets `func` on its parser.
Modules keep heavy imports (torch, the engine) inside the command function so `pdserve --help` stays fast."""
