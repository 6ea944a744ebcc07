"""The `rhymerl` subcommands, one module each: `train`, `report`, `generate` and `bench` (its benchmarks), each
with `add_parser(subparsers)` (its options) and its `cmd_*` function (what it runs); `options` holds what
they share (option types and checks, help texts) and `parser.build_parser` puts them together.

`rhymerl.cli.main` is the entry point: it parses, runs the command and turns bad input into one line.
"""
