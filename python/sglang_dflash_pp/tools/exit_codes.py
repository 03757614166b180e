"""The exit codes of the ``sglang-dflash-pp`` commands (one owner: the CLI and every tool it runs
return these)."""

EXIT_OK = 0  # accepted / verified
EXIT_FAILED = 1  # a verification or run failure
EXIT_USAGE = 2
EXIT_REFUSED = 3  # startup would refuse the deployment
EXIT_MISMATCH = 4  # the draft does not match its target (startup may still accept it)
EXIT_INTERRUPTED = 130  # SIGINT, as a shell reports it
