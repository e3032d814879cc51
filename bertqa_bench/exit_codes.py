"""What ``bertqa-bench`` returns, so a script or a CI job can act on a run without reading it.

One rule for every command that ends in a verdict (bench, bench-ddp, sweep, loadgen): a run
whose reference did not run judged nothing, and is never a success; FAIL and INCONCLUSIVE are
not passes either (a gate must be decided), unless the caller asks for a report only
(``--no-fail-on-verdict``). Input refused before any work, an interruption and a crash of the
tool itself each have their own code, so a script can tell "the backends broke parity" from
"my file was wrong" from "the machine was preempted" from "a bug".
"""
from __future__ import annotations

OK = 0  # PASS (or N/A: a timing-only suite on random weights, whose parity is not judged)
VERDICT_FAILED = 1  # FAIL or INCONCLUSIVE (exit 0 instead with --no-fail-on-verdict)
BAD_INPUT = 2  # refused before any work: a bad suite, file, checkpoint, option or path; usage errors
NO_REFERENCE = 3  # the reference did not run: nothing was judged (even with --no-fail-on-verdict)
INTERNAL_ERROR = 4  # an unexpected exception in bertqa-bench itself (its traceback is printed)
# 128 + N: stopped by signal N (143 SIGTERM, 130 SIGINT, 129 SIGHUP); the run is kept, resumable

EPILOG = """exit codes (bench, bench-ddp, sweep, loadgen; see README "Exit codes"):
  0    PASS (or N/A: timing-only random weights)
  1    FAIL or INCONCLUSIVE verdict (0 with --no-fail-on-verdict)
  2    input refused before any work (suite, file, checkpoint, option, results folder)
  3    NO REFERENCE: the reference did not run, nothing was judged (never 0)
  4    internal error (a bug in bertqa-bench; traceback printed)
  128+N  interrupted by signal N (143 SIGTERM, 130 Ctrl-C); finish with --resume
parity: 0 PASS, 1 anything else. Other commands: 0 done, 2 bad input."""


def for_verdict(status: str, fail_on_verdict: bool = True) -> int:
    """The exit code of a finished run with this verdict status."""
    if status in ("PASS", "N/A"):
        return OK
    if status == "NO REFERENCE":
        return NO_REFERENCE
    return VERDICT_FAILED if fail_on_verdict else OK
