"""Rewards: an LLM judge for proofs, math-verify for final answers, and the extraction helpers they share.

Every failure (network, HTTP status, timeout, unparsable output) becomes reward 0 with `valid=False`, so a
caller can both train on the row (AC2: "kept in the PPO update") and keep it out of anything that needs a
trustworthy value (AC2's critic targets), and count how often it happens.
"""

from __future__ import annotations

import asyncio
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

    None when the thinking section is unfinished or there is no complete proof block (spec/ac2.md).
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

    wrap = lambda s: s if ("$" in s or "\\boxed" in s) else f"${s}$"  # noqa: E731 - gold as $...$ (spec/rpo.md)
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
        """1.0 where `pred` is equivalent to `gold`; 0.0 for a missing pred, a mismatch, an error or a timeout."""
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
GRADING_PROMPT = """You are an expert grader of olympiad mathematics. Grade the proof below on a scale of 0 to 7.
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
    error: str | None = None


def parse_points(text: str | None) -> int | None:
    """Points from the judge's answer channel (spec/ac2.md): `<points>N out of 7</points>`, then
    `<points>N</points>`, then `N out of 7`; the last match of the first pattern that matches wins.

    Reasoning before a `</think>` is ignored (answer channel only). Out-of-range values are invalid.
    """
    if not text:
        return None
    answer = after_thinking(text)
    for pattern in (r"<points>\s*(\d+)\s*out\s+of\s+7\s*</points>", r"<points>\s*(\d+)\s*</points>",
                    r"\b(\d+)\s*out\s+of\s+7\b"):
        found = re.findall(pattern, answer, re.IGNORECASE)
        if found:
            n = int(found[-1])
            return n if 0 <= n <= 7 else None
    return None


@dataclasses.dataclass
class JudgeConfig:
    base_url: str
    model: str
    api_key_env: str = "JUDGE_API_KEY"  # the key is read from this environment variable, never logged
    max_concurrency: int = 64
    timeout_s: float = 600.0
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
              guidelines: list[str | None] | None = None) -> list[JudgeResult]:
        """Grade proofs (blocking; runs its own event loop). Reference and guidelines: validation only."""
        n = len(problems)
        references, guidelines = references or [None] * n, guidelines or [None] * n
        prompts = [self.prompt(*args) for args in zip(problems, proofs, references, guidelines)]
        return asyncio.run(self._grade_all(prompts))

    def check(self) -> str | None:
        """One tiny request at start-up, so an unreachable judge fails the run at once: None if it answered."""
        import openai

        async def ping():
            client = openai.AsyncOpenAI(base_url=self.cfg.base_url, timeout=min(self.cfg.timeout_s, 60.0),
                                        api_key=os.environ.get(self.cfg.api_key_env) or "EMPTY", max_retries=1)
            try:
                await client.chat.completions.create(model=self.cfg.model, max_tokens=1,
                                                     messages=[{"role": "user", "content": "Reply with 0."}])
            finally:
                await client.close()

        try:
            asyncio.run(ping())
        except openai.APIStatusError as e:
            return f"HTTP {e.status_code}" + (f" (is ${self.cfg.api_key_env} set?)" if e.status_code in (401, 403) else "")
        except Exception as e:
            return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        return None

    @staticmethod
    def prompt(problem: str, proof: str, reference: str | None = None, guidelines: str | None = None) -> str:
        return GRADING_PROMPT.format(
            problem=problem.strip(),
            proof=proof.strip(),
            reference_block=f"\n## Reference solution\n{reference.strip()}\n" if reference else "",
            guidelines_block=f"\n## Grading guidelines\n{guidelines.strip()}\n" if guidelines else "",
        )

    async def _grade_all(self, prompts: list[str]) -> list[JudgeResult]:
        import openai

        client = openai.AsyncOpenAI(
            base_url=self.cfg.base_url,
            api_key=os.environ.get(self.cfg.api_key_env) or "EMPTY",
            timeout=self.cfg.timeout_s,
            max_retries=0,  # our own retry policy below
        )
        limit = asyncio.Semaphore(self.cfg.max_concurrency)
        try:
            return await asyncio.gather(*(self._grade_one(client, limit, p) for p in prompts))
        finally:
            await client.close()

    async def _grade_one(self, client, limit: asyncio.Semaphore, prompt: str) -> JudgeResult:
        import openai

        error = "no attempt"
        for attempt in range(self.cfg.max_retries + 1):
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
                error = f"HTTP {e.status_code}"
                if 400 <= e.status_code < 500 and e.status_code not in (408, 429):
                    break  # not retryable
                continue
            except (asyncio.TimeoutError, openai.APITimeoutError):
                error = "timeout"
                continue
            except openai.APIConnectionError as e:
                error = f"connection error: {type(e).__name__}"
                continue
            except Exception as e:  # malformed body, unexpected schema: not worth retrying
                error = f"bad response: {type(e).__name__}"
                break
            try:
                content = resp.choices[0].message.content  # the answer channel; reasoning is a separate field
            except (AttributeError, IndexError, TypeError):
                content = None
            points = parse_points(content)
            if points is None:
                return JudgeResult(None, 0.0, False, "unparsable judge output")
            return JudgeResult(points, points / 7, True)
        return JudgeResult(None, 0.0, False, error)
