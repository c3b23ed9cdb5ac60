"""The code reward's call-based harness, copied beside the solution as `_harness.py` and run as `_harness.py
FN_NAME`: it runs the solution module, calls FN_NAME on the JSON arguments from stdin and writes the JSON result
to the original stdout; the program's own prints go to /dev/null. Stdlib only; never imported by the library."""
import io
import json
import os
import sys


def plain(x):
    """JSON-able form: tuples and sets become lists (sets sorted when possible)."""
    if hasattr(x, "tolist"):
        return x.tolist()  # numpy arrays and scalars
    if isinstance(x, (set, frozenset)):
        try:
            return sorted(x)
        except TypeError:
            return list(x)
    if hasattr(x, "__iter__") and not isinstance(x, (str, bytes, list, tuple, dict)):
        return list(x)  # generators, map objects, ranges
    return repr(x)


def main():
    fn_name, args = sys.argv[1], json.loads(sys.stdin.read())
    sys.stdin = io.StringIO("")  # a program that reads stdin at import time gets EOF, not our arguments
    result_out = os.fdopen(os.dup(1), "w")
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # prints (even os.write(1, ...)) cannot corrupt the result
    ns = {"__name__": "solution", "__file__": "solution.py"}
    with open("solution.py") as f:
        exec(compile(f.read(), "solution.py", "exec"), ns)
    fn = ns.get(fn_name)
    if fn is None and isinstance(ns.get("Solution"), type):
        fn = getattr(ns["Solution"](), fn_name, None)  # LeetCode style
    if not callable(fn):
        sys.exit(f"harness: function {fn_name!r} is not defined by the program")
    result = fn(**args) if isinstance(args, dict) else fn(*args)
    result_out.write(json.dumps(result, default=plain))
    result_out.flush()


if __name__ == "__main__":
    main()
