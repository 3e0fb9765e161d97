"""The queue as a pure state machine: commands are checked into events, events are applied.

No I/O, no clock, no randomness: the coordinator passes ``now`` and an id factory in,
journals the events and performs the effects (STYLE.md habit 1).
"""
