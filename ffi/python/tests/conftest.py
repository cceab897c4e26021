import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# The tests' own helpers (fake_engine). The package itself is the installed one
# (scripts/test-python.sh installs the wheel); without KVFABRIC_TEST_INSTALLED the source
# tree's copy is used instead, for a quick run against a cargo build (KVFABRIC_LIB).
sys.path.insert(0, HERE)
if not os.environ.get("KVFABRIC_TEST_INSTALLED"):
    sys.path.insert(0, os.path.join(HERE, ".."))
