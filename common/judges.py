"""Rewards: an LLM judge for proofs, math-verify for final answers, and the extraction helpers they share.

Every failure (network, HTTP status, timeout, unparsable output) becomes reward 0 with `valid=False`, so a
caller can both train on the row (AC2: "kept in the PPO update") and keep it out of anything that needs a
trustworthy value (AC2's critic targets), and count how often it happens.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import multiprocessing
import os
import random
import re

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------------
# Extraction
# ----------------------------------------------------------------------------------------------------
def after_thinking(response: str) -> str:
    """The answer channel: everything after the last `</think>` (the whole text if there is none)."""
    return response.rsplit("</think>", 1)[-1]


def extract_proof(response: str) -> str | None:
    """The proof of an AC2-style response: after the last `</think>`, the first `<proof>...</proof>`, stripped.

    None when the thinking section is unfinished or there is no complete proof block (docs/ac2.md, "The judge").
    """
    if "</think>" not in response:
        return None
    m = re.search(r"<proof>(.*?)</proof>", after_thinking(response), re.DOTALL)
    return m.group(1).strip() if m else None


def extract_boxed(text: str, which: str = "last") -> str | None:
    """Content of the first or last complete `\\boxed{...}` in `text`, braces matched by depth; else None."""
    found = []
    for m in re.finditer(r"\\boxed\s*\{", text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            found.append(text[m.end() : i - 1])
            if which == "first":
                break
    if not found:
        return None
    return found[0] if which == "first" else found[-1]


def extract_final_answer(response: str) -> str | None:
    """The last boxed answer after the thinking section; None when thinking never finished."""
    if "</think>" not in response:
        return None
    return extract_boxed(after_thinking(response))


# ----------------------------------------------------------------------------------------------------
# Answer verification with math-verify
# ----------------------------------------------------------------------------------------------------
def _verify_one(gold: str, pred: str, timeout_s: int) -> bool:
    """Runs in a worker process's main thread, where math-verify's SIGALRM timeouts are allowed."""
    from math_verify import parse, verify

    wrap = lambda s: s if ("$" in s or "\\boxed" in s) else f"${s}$"  # noqa: E731 - gold as $...$ (docs/rpo.md)
    gold_parsed = parse(wrap(gold), parsing_timeout=timeout_s)
    pred_parsed = parse(wrap(pred), parsing_timeout=timeout_s)
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout_s))  # gold first


class AnswerVerifier:
    """math-verify in a small process pool: safe to call from any thread, each answer bounded by a timeout.

    math-verify's own timeouts use SIGALRM, which only works in a main thread, and a hung sympy call cannot
    be interrupted from another thread; so each check runs in a worker process (its main thread), with
    math-verify's timeout inside and a hard deadline outside that restarts the pool if a worker hangs.
    """

    def __init__(self, workers: int = 2, timeout_s: int = 5):
        self.workers, self.timeout_s = workers, timeout_s
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None

    def _executor(self) -> concurrent.futures.ProcessPoolExecutor:
        if self._pool is None:  # spawn: never fork a process that holds an inference engine
            ctx = multiprocessing.get_context("spawn")
            self._pool = concurrent.futures.ProcessPoolExecutor(self.workers, mp_context=ctx)
        return self._pool

    def verify(self, golds: list[str], preds: list[str | None]) -> list[float]:
        """1.0 where `pred` is equivalent to `gold`; 0.0 for a missing pred, a mismatch, an error or a timeout.
        Under torchrun each rank checks its share and all get every result (common/parallel.py)."""
        from common import parallel

        pairs = list(zip(golds, preds))
        return parallel.shared_map(lambda share: self._verify([g for g, _ in share], [p for _, p in share]), pairs)

    def _verify(self, golds: list[str], preds: list[str | None]) -> list[float]:
        futures = {
            i: self._executor().submit(_verify_one, g, p, self.timeout_s)
            for i, (g, p) in enumerate(zip(golds, preds))
            if p is not None and p.strip()
        }
        scores = [0.0] * len(golds)
        hung = False
        for i, fut in futures.items():
            try:
                scores[i] = float(fut.result(timeout=None if hung else 3 * self.timeout_s + 30))
            except concurrent.futures.TimeoutError:
                hung = True
                log.warning("math-verify hung on answer %d; scored 0 and restarting its workers", i)
            except Exception as e:  # a parse error or a crashed worker: the answer is simply not verified
                log.debug("math-verify failed on answer %d: %r", i, e)
        if hung:
            self.close()
        return scores

    def close(self) -> None:
        if self._pool is not None:
            for p in list(getattr(self._pool, "_processes", {}).values()):
                p.kill()
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


# ----------------------------------------------------------------------------------------------------
# The LLM judge (OpenAI-compatible endpoint)
# ----------------------------------------------------------------------------------------------------
# Training grader: the released `finegrained_noref_judge.txt` allows only 7, 6, 1 or 0 points and asks for the grade
# once (docs/ac2.md, "The judge"). Its wording is not public; the four levels below are in our own words.
TRAINING_GRADES = (0, 1, 6, 7)
TRAINING_PROMPT = """You are an expert grader of olympiad mathematics. Grade the proof below with exactly one \
of these four scores; no other score is allowed:
- 7: a complete, correct and rigorous proof;
- 6: a correct proof with a minor gap or slip that is easy to repair;
- 1: not a proof, but real progress towards one (a correct key idea, lemma or reduction);
- 0: no real progress, a wrong answer, or claims left unjustified.

## Problem
{problem}

## Proof to grade
{proof}

Think about the proof carefully, then give your grade once, at the very end, in exactly this form:
<points>N out of 7</points>"""
# Validation grader (IMO-ProofBench style): the full 0-7 scale, with the reference solution and the guidelines.
VALIDATION_GRADES = tuple(range(8))
VALIDATION_PROMPT = """You are an expert grader of olympiad mathematics. Grade the proof below on a scale of 0 to 7.
A complete and rigorous proof earns 7; a proof with minor gaps earns 5-6; substantial progress earns 1-4; \
no meaningful progress, a wrong answer or an unjustified claim earns 0.

## Problem
{problem}
{reference_block}{guidelines_block}
## Proof to grade
{proof}

Think about the proof carefully, then end your answer with the grade in exactly this form:
<points>N out of 7</points>"""


@dataclasses.dataclass
class JudgeResult:
    points: int | None  # 0..7, None when invalid
    reward: float  # points / 7, and 0.0 when invalid
    valid: bool
    error: str | None = None  # "HTTP 400", "timeout", "connection error: ...", "unparsable judge output", ...
    detail: str | None = None  # the server's message or the unparsable answer, shortened (never the API key)


def parse_points(text: str | None, allowed=VALIDATION_GRADES) -> int | None:
    """Points from the judge's answer channel (docs/ac2.md, "The judge"): `<points>N out of 7</points>`, then
    `<points>N</points>`, then `N out of 7`; the *first* match of the first pattern that matches wins (the
    released parser). A value outside `allowed` (training: 0, 1, 6, 7) is invalid.

    Reasoning before a `</think>` is ignored (answer channel only).
    """
    if not text:
        return None
    answer = after_thinking(text)
    for pattern in (r"<points>\s*(\d+)\s*out\s+of\s+7\s*</points>", r"<points>\s*(\d+)\s*</points>",
                    r"\b(\d+)\s*out\s+of\s+7\b"):
        m = re.search(pattern, answer, re.IGNORECASE)
        if m:
            n = int(m.group(1))
            return n if n in allowed else None
    return None


@dataclasses.dataclass
class JudgeConfig:
    base_url: str
    model: str
    api_key_env: str = "JUDGE_API_KEY"  # the key is read from this environment variable, never logged
    max_concurrency: int = 64  # requests in flight for the whole run (under torchrun, shared by the ranks)
    timeout_s: float = 1800.0  # the released client's: a 40k-token grading takes minutes
    max_retries: int = 4
    backoff_s: float = 2.0
    temperature: float = 1.0
    max_tokens: int = 40_000


class Judge:
    """Async, bounded-concurrency client for an OpenAI-compatible chat endpoint that grades proofs 0-7.

    Retries timeouts, connection errors, 5xx, 408 and 429 with exponential back-off and jitter; never retries
    other 4xx (a bad request or a bad key will not get better). Every failure maps to reward 0, invalid.
    """

    def __init__(self, cfg: JudgeConfig):
        self.cfg = cfg

    def grade(self, problems: list[str], proofs: list[str], references: list[str | None] | None = None,
              guidelines: list[str | None] | None = None, validation: bool = False) -> list[JudgeResult]:
        """Grade proofs (blocking; runs its own event loop). Training: the 7/6/1/0 grader on problem + proof;
        validation: the 0-7 grader, with each problem's reference solution and grading guidelines if given."""
        from common import parallel

        n = len(problems)
        references, guidelines = references or [None] * n, guidelines or [None] * n
        prompts = [self.prompt(*args, validation=validation) for args in zip(problems, proofs, references, guidelines)]
        allowed = VALIDATION_GRADES if validation else TRAINING_GRADES
        # under torchrun each rank grades its share and all get every result (common/parallel.py)
        return parallel.shared_map(lambda share: asyncio.run(self._grade_all(share, allowed)), prompts)

    def check(self) -> str | None:
        """At start-up, before any model is loaded: one real training grading request -- the run's own
        temperature and max_tokens -- so an endpoint that is unreachable, refuses the key or rejects the request
        shape stops the run at once instead of turning every reward into an invalid 0. None if it graded."""
        from common import parallel

        prompt = self.prompt("Prove that the sum of two even integers is even.",
                             "Write them as 2a and 2b; their sum is 2(a + b), which is even.")
        # one request for the whole run: under torchrun rank 0 sends it and every rank gets the answer
        [res] = parallel.shared_map(lambda share: asyncio.run(self._grade_all(share, TRAINING_GRADES, max_retries=1)),
                                [prompt])
        if res.error is None:
            return None
        if res.error == "unparsable judge output":  # it answered the real request: the endpoint works
            print(f"warning: the judge {self.cfg.model} answered the start-up check without a parsable grade "
                  f"(<points>N out of 7</points>); such answers count as invalid rewards", flush=True)
            return None
        hint = f" (is ${self.cfg.api_key_env} set?)" if res.error in ("HTTP 401", "HTTP 403") else ""
        return res.error + hint + (f": {res.detail}" if res.detail else "")

    @staticmethod
    def prompt(problem: str, proof: str, reference: str | None = None, guidelines: str | None = None,
               validation: bool = False) -> str:
        if not validation:
            return TRAINING_PROMPT.format(problem=problem.strip(), proof=proof.strip())
        return VALIDATION_PROMPT.format(
            problem=problem.strip(),
            proof=proof.strip(),
            reference_block=f"\n## Reference solution\n{reference.strip()}\n" if reference else "",
            guidelines_block=f"\n## Grading guidelines\n{guidelines.strip()}\n" if guidelines else "",
        )

    async def _grade_all(self, prompts: list[str], allowed, max_retries: int | None = None) -> list[JudgeResult]:
        import openai

        client = openai.AsyncOpenAI(
            base_url=self.cfg.base_url,
            api_key=os.environ.get(self.cfg.api_key_env) or "EMPTY",
            timeout=self.cfg.timeout_s,
            max_retries=0,  # our own retry policy below
        )
        from common import parallel

        limit = asyncio.Semaphore(max(1, self.cfg.max_concurrency // parallel.WORLD))  # the run's total, over ranks
        retries = self.cfg.max_retries if max_retries is None else max_retries
        try:
            return await asyncio.gather(*(self._grade_one(client, limit, p, allowed, retries) for p in prompts))
        finally:
            await client.close()

    async def _grade_one(self, client, limit: asyncio.Semaphore, prompt: str, allowed, retries: int) -> JudgeResult:
        import openai

        error, detail = "no attempt", None
        for attempt in range(retries + 1):
            if attempt:
                await asyncio.sleep(self.cfg.backoff_s * 2 ** (attempt - 1) * (0.5 + random.random()))
            try:
                async with limit:
                    resp = await asyncio.wait_for(
                        client.chat.completions.create(
                            model=self.cfg.model,
                            messages=[{"role": "user", "content": prompt}],
                            temperature=self.cfg.temperature,
                            max_tokens=self.cfg.max_tokens,
                        ),
                        timeout=self.cfg.timeout_s,
                    )
            except openai.APIStatusError as e:
                error, detail = f"HTTP {e.status_code}", _short(getattr(e, "message", None) or str(e))
                if 400 <= e.status_code < 500 and e.status_code not in (408, 429):
                    break  # not retryable
                continue
            except (TimeoutError, openai.APITimeoutError):
                error, detail = "timeout", f"no answer within {self.cfg.timeout_s:.0f} s"
                continue
            except openai.APIConnectionError as e:
                error, detail = f"connection error: {type(e).__name__}", _short(str(e.__cause__ or e))
                continue
            except Exception as e:  # malformed body, unexpected schema: not worth retrying
                error, detail = f"bad response: {type(e).__name__}", _short(str(e))
                break
            try:
                content = resp.choices[0].message.content  # the answer channel; reasoning is a separate field
            except (AttributeError, IndexError, TypeError):
                content = None
            points = parse_points(content, allowed)
            if points is None:
                return JudgeResult(None, 0.0, False, "unparsable judge output", _short(content or "(empty)"))
            return JudgeResult(points, points / 7, True)
        return JudgeResult(None, 0.0, False, error, detail)


def _short(text: str, n: int = 200) -> str:
    """One line of at most n characters, for messages."""
    line = " ".join(str(text).split())
    return line if len(line) <= n else line[: n - 3] + "..."


# ----------------------------------------------------------------------------------------------------
# A run's judge: checked before any model is loaded, stopped when it keeps failing
# ----------------------------------------------------------------------------------------------------
def start_judge(args, master: bool) -> Judge:
    """The run's judge from its --judge-* flags, checked with one real grading request before any model is loaded:
    an unreachable endpoint, a refused key or a rejected request shape stops the run here, in one sentence."""
    judge = Judge(JudgeConfig(args.judge_base_url, args.judge_model, args.judge_api_key_env,
                              args.judge_max_concurrency, args.judge_timeout_s, args.judge_max_retries,
                              temperature=args.judge_temperature, max_tokens=args.judge_max_tokens))
    if master:
        print(f"checking the judge {args.judge_model} at {args.judge_base_url} with one real grading request...",
              flush=True)
    if (err := judge.check()) is not None:
        raise SystemExit(f"the judge {args.judge_model} at {args.judge_base_url} failed a grading request with "
                         f"the run's settings (max_tokens {args.judge_max_tokens}, temperature "
                         f"{args.judge_temperature}): {err}")
    return judge


def judge_failure_streak(calls: list[tuple[str | None, str | None]], streak: int) -> tuple[int, str | None]:
    """A step in which more than half of the judge calls failed extends the streak and explains itself (the
    causes, most frequent first, with one server message each); any other step ends the streak. Failed calls
    are invalid zeros, kept in the update, so a dead judge would train the policy on noise."""
    failed = [(e, d) for e, d in calls if e is not None]
    if not calls or 2 * len(failed) <= len(calls):
        return 0, None
    causes = collections.Counter(e for e, _ in failed)
    detail = dict(reversed(failed))  # the first message of each cause
    listed = "; ".join(f"{e} x{k}" + (f" ({detail[e]})" if detail[e] else "") for e, k in causes.most_common())
    return streak + 1, f"{len(failed)} of {len(calls)} judge calls failed: {listed}"


@dataclasses.dataclass
class Watch:
    """The two ways a run can train on nothing for hours, counted in consecutive steps: a judge that fails most of
    its calls (invalid zeros), and responses none of which holds an answer the judge or verifier can grade (every
    reward 0, and with a judge, no call made at all: a model that ignores the prompt's format)."""

    judge_failures: int = 0
    ungradable: int = 0


def watch_scores(watch: Watch, calls, gradable: int, total: int, what: str, template_flag: str, step: int, args,
                 master: bool, save_before_step) -> None:
    """Update `watch` with this step (the judge's calls; how many of `total` responses hold `what`, the answer
    format the scorer needs) and warn as a streak grows. At --judge-max-invalid-steps failing steps, or
    --max-ungradable-steps steps without a gradable answer, the run stops with the state before this step saved
    (`save_before_step()` writes it and returns its folder) rather than train on zeros."""
    watch.judge_failures, warning = judge_failure_streak(calls, watch.judge_failures)
    if warning and master:
        print(f"warning: step {step}: {warning}", flush=True)
    if warning and watch.judge_failures >= args.judge_max_invalid_steps:
        path = save_before_step()
        raise SystemExit(f"stopped: more than half of the judge's calls failed in {watch.judge_failures} consecutive "
                         f"steps (last: {warning}). The state before step {step} is saved in {path}; fix the judge, "
                         f"then continue with --resume {path}")
    watch.ungradable = watch.ungradable + 1 if total and not gradable else 0
    if watch.ungradable and master:
        print(f"warning: step {step}: none of its {total} responses holds {what}, so every reward is 0 and the step "
              f"trains on nothing; does the prompt ({template_flag}) ask for that format? ({watch.ungradable} such "
              f"step(s) in a row; the run stops at --max-ungradable-steps {args.max_ungradable_steps})", flush=True)
    if watch.ungradable and watch.ungradable >= args.max_ungradable_steps:
        path = save_before_step()
        raise SystemExit(f"stopped: no response held {what} in {watch.ungradable} consecutive steps. The state "
                         f"before step {step} is saved in {path}; fix the prompt ({template_flag}) or the model, "
                         f"then continue with --resume {path}")
