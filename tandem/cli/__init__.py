"""The `tandem` command line: the top floor, the one part of `tandem` that may import `services`.

`main.py` dispatches `tandem COMMAND` to one module per command: `up` (with `supervisor`, which
keeps its children running), `deploy`, `trace` (with `trace_view`, which draws the waterfall),
`model` and `generate` here; `gateway`, `scheduler`, `prefill`, `decode`, `colocated` and
`health` in the `main` module of their service. `python -m tandem.cli` runs the same command.
"""
