"""Fuzzing the HTTP surface from its own OpenAPI document with schemathesis, against a real
``lmserve`` process (scripted backend): no 5xx, no hang, and the server healthy afterwards.
``nox -s fuzz`` runs the same with more examples per operation."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest
from processes import API_KEY

pytestmark = pytest.mark.slow

EXAMPLES = int(os.environ.get("LMSERVE_FUZZ_EXAMPLES", "12"))


def test_no_operation_answers_5xx_to_generated_requests(start_server) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("schemathesis")
    # every capability the scripted backend can declare, token-id prompts included: a
    # capability it lacks is a documented 501, which is no server error to look for here
    caps = "grammar,reasoning,tools,logit_bias,token_prompts"
    srv = start_server("--queue", "64", env={"LMSERVE_SCRIPTED_CAPS": caps})
    out = subprocess.run(
        [sys.executable, "-m", "schemathesis.cli", "run", srv.base_url + "/schema/openapi.json",
         "--checks", "not_a_server_error", "--max-examples", str(EXAMPLES),
         "--header", f"Authorization: Bearer {API_KEY}", "--request-timeout", "30",
         "--generation-deterministic", "--phases", "coverage,fuzzing"],
        capture_output=True, text=True, timeout=1800,
    )
    assert out.returncode == 0, out.stdout[-8000:] + out.stderr[-2000:]
    assert "passed" in out.stdout
    assert httpx.get(srv.base_url + "/health", timeout=10).status_code == 200
    assert srv.process.poll() is None
