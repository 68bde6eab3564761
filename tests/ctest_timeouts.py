#!/usr/bin/env python3
"""Every CTest test of the build has a TIMEOUT (tests/CMakeLists.txt): one hung
mpirun must fail its own test, not hold CI until the job's limit.

    tests/ctest_timeouts.py CTEST BUILD_DIR
"""
import json
import subprocess
import sys

ctest, build = sys.argv[1], sys.argv[2]
listing = subprocess.run([ctest, "--test-dir", build, "--show-only=json-v1"],
                         capture_output=True, text=True, check=True)
tests = json.loads(listing.stdout)["tests"]
if len(tests) < 10:
    sys.exit("ctest_timeouts: only %d tests listed in %s" % (len(tests), build))


def timeout(test):
    for p in test.get("properties", []):
        if p["name"] == "TIMEOUT":
            return float(p["value"])
    return 0.0


# A gtest binary that is not built yet shows as <target>_NOT_BUILT, a test
# that fails by itself.
missing = [t["name"] for t in tests if timeout(t) <= 0 and not t["name"].endswith("_NOT_BUILT")]
if missing:
    print("tests without a TIMEOUT (%d of %d):" % (len(missing), len(tests)))
    for name in missing:
        print("  " + name)
    sys.exit(1)
print("all %d tests have a TIMEOUT (longest %.0f s)" % (len(tests), max(timeout(t) for t in tests)))
