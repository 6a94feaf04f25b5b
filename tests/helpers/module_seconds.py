"""Refresh tests/module_seconds.json (each test file's seconds, the order `make test` hands files to its workers)
from a run's JUnit report (serial or on two workers: only the order matters):

    make test ARGS=--junitxml=/tmp/junit.xml; .venv/bin/python tests/helpers/module_seconds.py /tmp/junit.xml
"""

import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

seconds: Counter = Counter()
for case in ET.parse(sys.argv[1]).getroot().iter("testcase"):
    seconds[case.get("classname").split(".")[-1] + ".py"] += float(case.get("time"))
out = Path(__file__).resolve().parents[1] / "module_seconds.json"
out.write_text(json.dumps({k: round(v) for k, v in seconds.most_common()}, indent=1) + "\n")
