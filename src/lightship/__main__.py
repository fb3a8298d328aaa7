"""`python -m lightship`: the same command as the `lightship` script, with the same exit code.

CPython 3.11 remembers a KeyboardInterrupt that left any `exec` of a string (dataclasses and
namedtuple build their methods so, when FastAPI or torch is imported) and, under `-m` only,
ends the process with SIGINT after its SystemExit: a SIGTERM as the server started, which the
CLI reports as "interrupted" with 143, exited 130. An `exec` of a string that ends without one
clears what it remembered; a KeyboardInterrupt that leaves `main` is still reported as one.
"""

from lightship._start import main

try:
    main()
finally:
    exec("")
