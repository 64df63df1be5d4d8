"""The distillation examples against a server holding two tiny models (student first, teacher second): on-policy
GKD lowers the reverse KL to the teacher, offline distillation lowers the student's loss on the teacher's answers."""

from __future__ import annotations

import math

import pytest

from tests.examples.conftest import run_example
from tests.support.server import ServerProcess

pytestmark = pytest.mark.timeout(600)


def test_gkd_on_policy(student_teacher_server: ServerProcess) -> None:
    srv = student_teacher_server
    out, stdout = run_example("gkd_on_policy.py", "--base-url", srv.base_url, "--steps", "12", "--lr", "5e-3",
                              "--rank", "8", api_key=srv.api_key_a)  # type: ignore[attr-defined]
    assert (out["student"], out["teacher"]) == ("tiny-student", "tiny-teacher"), out  # the served order by default
    assert math.isfinite(out["first_kl"]) and out["first_kl"] > 0, out
    assert out["last_kl"] < out["first_kl"] and out["mean_kl_second_half"] < out["mean_kl_first_half"], out
    assert stdout.count("reverse KL") == 12


def test_gkd_offline(student_teacher_server: ServerProcess) -> None:
    srv = student_teacher_server
    out, stdout = run_example("gkd_offline.py", "--base-url", srv.base_url, "--steps", "5", "--lr", "1e-2",
                              "--rank", "8", api_key=srv.api_key_a)  # type: ignore[attr-defined]
    assert out["teacher"] == "tiny-teacher" and out["answers"] > 0, out
    assert math.isfinite(out["first_loss"]) and out["last_loss"] < out["first_loss"] * 0.9, out
    assert "tiny-teacher wrote" in stdout


def test_distillation_needs_a_teacher(server: ServerProcess) -> None:
    """On a server with one model the examples stop with a message saying how to serve a teacher."""
    import os
    import subprocess
    import sys

    from tests.examples.conftest import EXAMPLES

    env = {**os.environ, "TWINKLE_API_KEY": server.api_key_a}  # type: ignore[attr-defined]
    out = subprocess.run([sys.executable, str(EXAMPLES / "gkd_offline.py"), "--base-url", server.base_url],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode != 0 and "second --base-model" in out.stderr, out
