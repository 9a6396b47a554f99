"""Re-record tests/data/golden/ and tests/data/checkpoint_0.2/.

  python tests/record_golden.py            # every case
  python tests/record_golden.py -k zen     # some (pytest's -k)

Runs tests/test_golden.py under pytest (so with the test suite's XLA flags
and 8 CPU devices, which the bits depend on) in record mode: each case
writes what it computed and then compares against it. Run it only for a
change of results that is meant, on the unchanged library of the commit
that defines them, and say in the commit why the bits moved.
"""

import os
import pathlib
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent


def main(argv) -> int:
  os.environ["JAXFUSE_RECORD_GOLDEN"] = "1"
  sys.path.insert(0, str(HERE.parent))
  return pytest.main(["-p", "no:cacheprovider", "-q",
                      str(HERE / "test_golden.py"), *argv])


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
