"""The example third-party package (examples/plugins), pip-installed from a copy: found through its
``kvloom.plugins`` entry point, listed by ``engine plugins``, and scheduling requests.

pip installs it into a temporary site directory (``--target``) that the checks' Python processes put
on their path, so the shared environment is never changed, even when the test is interrupted."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = "kvloom-example-scheduler"

GENERATE = """
import json, sys
from kvloom import LLM, SamplingParams
llm = LLM(sys.argv[1], plugins=["shortest_output"], max_num_seqs=1, num_kv_blocks=32, block_size=8)
params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (8, 2, 4)]
outs = llm.generate([[5, 6, 7], [8, 9], [10, 11, 12]], params, use_tqdm=False)
order = sorted(range(3), key=lambda i: outs[i].metrics.first_token_time)
print(json.dumps({"policy": llm.engine.scheduler.policy.name, "order": order}))
"""


def _python(site: Path, *args: str) -> str:
    # This checkout's kvloom (whatever kvloom the environment has installed) and the installed example.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(site)]))
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture
def example_site(tmp_path) -> Path:
    copy, site = tmp_path / "example", tmp_path / "site"
    shutil.copytree(REPO / "examples" / "plugins", copy)
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "--quiet", "install", "--no-deps",
                    "--no-build-isolation", "--target", str(site), str(copy)], check=True, timeout=300)
    return site


def test_example_package_is_found_through_its_entry_point_and_schedules(example_site, tiny_llama):
    rows = {r["name"]: r for r in json.loads(_python(example_site, "-m", "kvloom.cli", "plugins", "--json"))}
    row = rows["shortest_output"]
    assert row["kind"] == "scheduler" and row["error"] is None
    assert row["origin"] == f"entry point of {PACKAGE} 0.1.0"
    assert [o["name"] for o in row["options"]] == ["max_wait_s"]

    result = json.loads(_python(example_site, "-c", GENERATE, str(tiny_llama)).splitlines()[-1])
    assert result == {"policy": "shortest_output", "order": [1, 2, 0]}  # smallest max_tokens first
