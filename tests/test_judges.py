"""Judge client against a real local HTTP server; points parsing; extraction; math-verify."""

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from common.judges import (
    TRAINING_GRADES,
    AnswerVerifier,
    Judge,
    JudgeConfig,
    extract_boxed,
    extract_final_answer,
    extract_proof,
    parse_points,
)

KEY = "sk-test-secret-123"


class StubJudge(BaseHTTPRequestHandler):
    """An OpenAI-compatible /chat/completions whose behaviour is chosen by a MODE:<name> tag in the prompt."""

    hits: ClassVar[dict] = {}
    lock = threading.Lock()
    max_tokens_limit: int | None = None  # like an endpoint whose model allows fewer output tokens than asked
    requests: ClassVar[list] = []

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = body["messages"][0]["content"]
        mode = prompt.split("MODE:")[1].split()[0] if "MODE:" in prompt else "ok7"
        with self.lock:
            n = self.hits[mode] = self.hits.get(mode, 0) + 1
            self.requests.append(body)
        if self.headers.get("Authorization") != f"Bearer {KEY}":
            return self._send(401, {"error": {"message": "bad key"}})
        if self.max_tokens_limit is not None and body.get("max_tokens", 0) > self.max_tokens_limit:
            return self._send(400, {"error": {"message": f"max_tokens must be <= {self.max_tokens_limit}"}})
        if mode == "flaky" and n <= 2:
            return self._send(500, {"error": {"message": "overloaded"}})
        if mode == "always500":
            return self._send(500, {"error": {"message": "down"}})
        if mode == "bad400":
            return self._send(400, {"error": {"message": "bad request"}})
        if mode == "hang":
            time.sleep(3)
        if mode == "garbage_body":
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b"<html>definitely not json")
            return
        content = {
            "ok7": "Looks complete.\n<points>7 out of 7</points>",
            "ok6": "A small slip.\n<points>6 out of 7</points>",
            "ok3": "Gaps.\n<points>3 out of 7</points>",
            "garbage": "I refuse to grade this.",
            "channel": "<think>maybe <points>7 out of 7</points></think>Final: <points>2 out of 7</points>",
            "reasoning_field": "Final: <points>4 out of 7</points>",
        }.get(mode, "<points>7 out of 7</points>")
        message = {"role": "assistant", "content": content}
        if mode == "reasoning_field":
            message["reasoning_content"] = "<points>7 out of 7</points>"
        self._send(200, {"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                         "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                         "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

    def _send(self, code, payload):
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture()
def server(monkeypatch):
    StubJudge.hits, StubJudge.requests, StubJudge.max_tokens_limit = {}, [], None
    srv = ThreadingHTTPServer(("127.0.0.1", 0), StubJudge)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    monkeypatch.setenv("STUB_JUDGE_KEY", KEY)
    yield f"http://127.0.0.1:{srv.server_address[1]}/v1"
    srv.shutdown()


def make_judge(url, **kw):
    cfg = dict(base_url=url, model="stub", api_key_env="STUB_JUDGE_KEY", max_concurrency=4, timeout_s=1.0,
               max_retries=3, backoff_s=0.01)
    cfg.update(kw)
    return Judge(JudgeConfig(**cfg))


def test_judge_grades_retries_and_maps_every_failure_to_invalid_zero(server, caplog):
    caplog.set_level(logging.DEBUG)
    modes = ["ok7", "ok3", "flaky", "always500", "bad400", "hang", "garbage", "garbage_body", "channel",
             "reasoning_field"]
    t0 = time.time()
    results = make_judge(server).grade([f"P MODE:{m} " for m in modes], ["proof"] * len(modes))
    by = dict(zip(modes, results))
    assert (by["ok7"].points, by["ok7"].reward, by["ok7"].valid) == (7, 1.0, True)
    assert not by["ok3"].valid and by["ok3"].error == "unparsable judge output"  # 3: not a training grade
    assert by["flaky"].valid and by["flaky"].points == 7 and StubJudge.hits["flaky"] == 3  # 2 x 500, then ok
    assert not by["always500"].valid and StubJudge.hits["always500"] == 4  # 1 try + 3 retries
    assert not by["bad400"].valid and StubJudge.hits["bad400"] == 1  # 4xx: never retried
    assert not by["hang"].valid and by["hang"].error == "timeout"
    assert not by["garbage"].valid and by["garbage"].error == "unparsable judge output"
    assert not by["garbage_body"].valid
    assert not by["channel"].valid  # only the answer channel counts, and 2 is not a training grade
    assert not by["reasoning_field"].valid  # a separate reasoning field is ignored (4: not a training grade)
    for r in results:
        if not r.valid:
            assert r.reward == 0.0 and r.points is None
    assert time.time() - t0 < 30
    assert KEY not in caplog.text and all(KEY not in (r.error or "") for r in results)


def test_judge_bounded_concurrency(server):
    # 8 hanging requests, 4 at a time, 1 s timeout and no retries: two waves, so at least ~2 s
    t0 = time.time()
    results = make_judge(server, max_retries=0, max_concurrency=4).grade(["MODE:hang"] * 8, ["p"] * 8)
    assert all(not r.valid for r in results)
    assert 1.9 < time.time() - t0 < 10


def test_judge_bad_key_is_not_retried_and_check_reports_it(server, monkeypatch):
    monkeypatch.setenv("STUB_JUDGE_KEY", "wrong")
    judge = make_judge(server)
    [res] = judge.grade(["MODE:ok7"], ["p"])
    assert not res.valid and res.error == "HTTP 401" and StubJudge.hits["ok7"] == 1
    assert "401" in judge.check() and "STUB_JUDGE_KEY" in judge.check()
    monkeypatch.setenv("STUB_JUDGE_KEY", KEY)
    assert judge.check() is None


def test_judge_unreachable_endpoint_fails_fast():
    judge = make_judge("http://127.0.0.1:9/v1", max_retries=1)
    [res] = judge.grade(["p"], ["q"])
    assert not res.valid and res.error.startswith("connection error")
    assert judge.check() is not None


def test_judge_prompts_training_four_levels_validation_with_reference_and_guidelines():
    train = Judge.prompt("Prob", "Proof", "Ref sol", "Rubric")  # training never shows a reference
    assert "Ref sol" not in train and "Rubric" not in train and "Prob" in train and "Proof" in train
    assert all(f"- {n}:" in train for n in (7, 6, 1, 0)) and "no other score" in train
    plain = Judge.prompt("Prob", "Proof", validation=True)
    full = Judge.prompt("Prob", "Proof", "Ref sol", "Rubric", validation=True)
    assert "Ref sol" not in plain and "Reference solution" not in plain and "Grading guidelines" not in plain
    assert "Ref sol" in full and "Rubric" in full and full.index("Prob") < full.index("Ref sol") < full.index("Proof")
    assert "scale of 0 to 7" in full


def test_validation_grades_the_full_scale(server):
    [res] = make_judge(server).grade(["P MODE:ok3"], ["p"], ["ref"], ["rubric"], validation=True)
    assert (res.points, res.valid) == (3, True)
    [res] = make_judge(server).grade(["P MODE:ok6"], ["p"])
    assert (res.points, res.reward, res.valid) == (6, 6 / 7, True)


def test_check_sends_the_real_request_shape_and_names_the_refusal(server):
    judge = make_judge(server, max_tokens=40_000, temperature=1.0)
    assert judge.check() is None
    sent = StubJudge.requests[-1]
    assert sent["max_tokens"] == 40_000 and sent["temperature"] == 1.0 and "Proof to grade" in \
        sent["messages"][0]["content"]
    StubJudge.max_tokens_limit = 8192  # an endpoint that would refuse every real grading request
    err = judge.check()
    assert err is not None and "HTTP 400" in err and "max_tokens must be <= 8192" in err
    [res] = judge.grade(["P"], ["proof"])
    assert not res.valid and res.error == "HTTP 400"


@pytest.mark.parametrize("text,points", [
    ("<points>6 out of 7</points>", 6),
    ("blah <points> 5 out of 7 </points> then <points>3 out of 7</points>", 5),  # the first one (released parser)
    ("<points>4</points>", 4),  # first fallback
    ("I'd give it 2 out of 7.", 2),  # second fallback
    ("<points>7 out of 7</points> but <points>1</points>", 7),  # the preferred pattern wins over fallbacks
    ("<points>9 out of 7</points>", None),  # out of range
    ("no grade here", None),
    ("", None),
    (None, None),
    ("<think>7 out of 7</think>nothing after", None),  # answer channel only
])
def test_parse_points(text, points):
    assert parse_points(text) == points


@pytest.mark.parametrize("text,points", [
    ("<points>7 out of 7</points>", 7), ("<points>6 out of 7</points>", 6), ("<points>1 out of 7</points>", 1),
    ("<points>0 out of 7</points>", 0),
    ("<points>5 out of 7</points>", None), ("<points>3 out of 7</points>", None),  # no partial credit in training
    ("<points>6 out of 7</points> ... on reflection <points>7 out of 7</points>", 6),  # asked once: the first
])
def test_training_grader_allows_only_7_6_1_0(text, points):
    assert parse_points(text, TRAINING_GRADES) == points


def test_extraction_helpers():
    assert extract_proof("think</think>\n<proof>\n A proof. \n</proof> <proof>2nd</proof>") == "A proof."
    assert extract_proof("<proof>inside thinking</proof></think> no proof after") is None
    assert extract_proof("<proof>never closed the thinking</proof>") is None
    assert extract_proof("</think><proof>unclosed") is None
    assert extract_boxed(r"\boxed{\frac{1}{2}} and \boxed{3}") == "3"
    assert extract_boxed(r"\boxed{\frac{1}{2}} and \boxed{3}", which="first") == r"\frac{1}{2}"
    assert extract_boxed(r"\boxed{\frac{1}{2}") is None  # unclosed
    assert extract_final_answer(r"\boxed{1}</think>so \boxed{2}") == "2"
    assert extract_final_answer(r"\boxed{1} no end of thinking") is None


def test_math_verify_cases_and_timeout_safety():
    v = AnswerVerifier(workers=1, timeout_s=5)
    try:
        golds = ["1/2", "\\frac{1}{2}", "3", "x^2+1", "\\sqrt{2}", "(1,2)", "7", "7"]
        preds = ["0.5", "\\frac{2}{4}", "4", "1+x^2", "2^{1/2}", "(1, 2)", None, "   "]
        assert v.verify(golds, preds) == [1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0]
        # callable from another thread (math-verify's own SIGALRM timeouts would refuse that)
        out = []
        t = threading.Thread(target=lambda: out.append(v.verify(["2"], ["2"])))
        t.start()
        t.join(60)
        assert out == [[1.0]]
    finally:
        v.close()


def test_a_step_with_most_judge_calls_failed_warns_with_causes_and_extends_the_streak():
    from common.judges import judge_failure_streak as streak_of

    ok, bad400, timeout = (None, None), ("HTTP 400", "max_tokens must be <= 8192"), ("timeout", "no answer")
    streak, warning = streak_of([bad400, bad400, timeout, ok], 0)
    assert streak == 1 and warning == ("3 of 4 judge calls failed: HTTP 400 x2 (max_tokens must be <= 8192); "
                                       "timeout x1 (no answer)")
    assert streak_of([bad400] * 3, 2)[0] == 3  # the third such step in a row: the run stops (default 3)
    assert streak_of([bad400, ok], 2) == (0, None)  # exactly half is not "more than half": the streak ends
    assert streak_of([], 2) == (0, None)  # no judge calls this step (no proofs): nothing to judge the judge by


def test_scripts_check_the_judge_before_loading_any_model(tmp_path):
    import os
    import subprocess
    import sys

    from conftest import ROOT

    (tmp_path / "p.jsonl").write_text('{"problem": "Prove that 1 = 1."}\n')
    missing = str(tmp_path / "no-such-model")  # loading it first would fail with "could not load model"
    judge = ["--judge-base-url", "http://127.0.0.1:9/v1", "--judge-max-retries", "0", "--eval-every", "0"]
    for script, data in (("grpo.py", ["--reward", "judge", "--dataset", "tiny"]),
                         ("ac2.py", ["--dataset", str(tmp_path / "p.jsonl")])):
        proc = subprocess.run([sys.executable, str(ROOT / script), "--model", missing, *data, *judge], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert proc.returncode != 0
        assert "the judge" in proc.stderr and "connection error" in proc.stderr, proc.stderr[-2000:]
        assert "could not load model" not in proc.stderr


def test_steps_without_a_gradable_answer_warn_and_then_stop_with_the_state_saved(capsys):
    from types import SimpleNamespace

    from common.judges import Watch, watch_scores

    args, watch, saved = SimpleNamespace(judge_max_invalid_steps=3, max_ungradable_steps=2), Watch(), []
    save = lambda: saved.append(1) or "ckpt/step_4"  # noqa: E731
    watch_scores(watch, [], 0, 8, "a <proof> block", "--prompt-template", 5, args, True, save)
    out = capsys.readouterr().out
    assert watch.ungradable == 1 and "step 5: none of its 8 responses holds a <proof> block" in out
    assert "--prompt-template" in out and not saved
    watch_scores(watch, [], 1, 8, "a <proof> block", "--prompt-template", 6, args, True, save)
    assert watch.ungradable == 0  # one gradable answer ends the streak
    watch_scores(watch, [], 0, 8, "a <proof> block", "--prompt-template", 7, args, True, save)
    with pytest.raises(SystemExit, match=r"no response held a <proof> block in 2 consecutive steps.*ckpt/step_4"):
        watch_scores(watch, [], 0, 8, "a <proof> block", "--prompt-template", 8, args, True, save)
    assert saved == [1]


@pytest.mark.slow
def test_a_policy_that_never_writes_a_proof_is_stopped_instead_of_training_on_zeros(server, tmp_path):
    """The tiny policy with a real judge and a proof data set: no rollout ever holds a <proof> block, so no judge
    call is made and every reward is 0. Each such step warns; the second stops the run with the state saved."""
    import os
    import subprocess
    import sys

    from conftest import ROOT

    problems = [json.dumps({"problem": f"Add: {a}+{a + 1}"}) for a in range(10, 30)]
    (tmp_path / "p.jsonl").write_text("\n".join(problems) + "\n")
    proc = subprocess.run([sys.executable, str(ROOT / "grpo.py"), "--tiny", "--reward", "judge", "--dataset",
                           str(tmp_path / "p.jsonl"), "--judge-base-url", server, "--judge-api-key-env",
                           "STUB_JUDGE_KEY", "--judge-model", "stub", "--problems-per-step", "4", "--group-size", "2",
                           "--eval-every", "0", "--max-ungradable-steps", "2", "--save-every", "5", "--run-name",
                           "noproof"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode != 0
    assert proc.stdout.count("responses holds a complete <proof> block after </think>, so every reward is 0") == 2
    assert "no response held a complete <proof> block after </think> in 2 consecutive steps" in proc.stderr
    assert (tmp_path / "checkpoints/noproof/step_1/trainer_state.pt").exists()  # the state before step 2
    assert len(StubJudge.requests) == 1  # the start-up check only: no rollout gave the judge anything to grade
