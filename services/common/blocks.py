"""How many fixed-size units hold a count: KV blocks for tokens, chunks for blocks. One definition
for the scheduler and the runtime, torch-free like the block-hash chain it sits beside.
"""

from __future__ import annotations


def ceil_div(count: int, unit: int) -> int:
    """The number of `unit`-sized pieces that hold `count` items (the last may be partial)."""
    return -(-count // unit)
