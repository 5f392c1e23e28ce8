"""What the runtime knows of programs: the segments of a program that it executes in one
request (segment.py) and how a `select` picks among its choices (choices.py)."""
