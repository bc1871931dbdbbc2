"""A worker for tests/test_distributed.py: `python tests/dist_worker.py OUT` (one rank) or `torchrun
--nproc_per_node 2 tests/dist_worker.py OUT` (two), with the real vLLM engine in every rank.

It loads the model (`parallel.load_model`: rank 0 alone reads the weights), samples a fixed set of seeded requests
(each rank its share, everyone receives all), takes one sharded training step on them, syncs the new weights into
every rank's engine and samples again; then it writes, from rank 0, the completions, the weights after the step,
which ranks read the weights, and for each rank's engine the largest gap between its sampling log-probabilities and
the trainer's on the same tokens.
"""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import grpo  # noqa: E402
from common import engine, parallel  # noqa: E402
from common.tiny import build_tokenizer, tiny_dataset, tiny_model_path  # noqa: E402


def trainer_logprobs(model, tok, prompts, groups, device):
    """The trainer's log-probabilities of every sampled token (every rank computes all: FSDP forwards match)."""
    seqs = [p + c.token_ids for p, g in zip(prompts, groups) for c in g]
    starts = [len(p) for p, g in zip(prompts, groups) for _ in g]
    lens = [len(c.token_ids) for g in groups for c in g]
    out = {}
    with torch.no_grad():
        for micro in grpo.make_micro_batches(list(range(len(seqs))), [len(s) for s in seqs], 512):
            ids = grpo.pad_batch([seqs[i] for i in micro], device)
            lp, _ = grpo.sequence_logprobs(model, ids, [starts[i] for i in micro], [lens[i] for i in micro], 1.0, 64)
            out.update(zip(micro, lp.split([lens[i] for i in micro])))
    return [out[i] for i in range(len(seqs))]


def main(out_dir: Path) -> None:
    from vllm import SamplingParams

    rank, world, device = parallel.init()
    path = tiny_model_path()
    tok = build_tokenizer()
    reads = []  # which ranks read the weights from disk: rank 0 only, the others receive their shards
    real = AutoModelForCausalLM.from_pretrained
    AutoModelForCausalLM.from_pretrained = lambda *a, **k: reads.append(rank) or real(*a, **k)
    model = parallel.load_model(path, device)
    AutoModelForCausalLM.from_pretrained = real
    readers = parallel.shared_map(lambda share: [reads for _ in share], list(range(world)))  # rank r: who read
    llm = engine.create_engine(path, max_model_len=512, seed=0)
    engine.sync_weights(llm, model)
    prompts = [grpo.encode_chat(tok, r["problem"]) for r in tiny_dataset("test")[:10]]

    def sample(round_: int):
        params = [SamplingParams(n=2, temperature=1.0, max_tokens=60, logprobs=0, seed=grpo.request_seed(7, round_, i))
                  for i in range(len(prompts))]
        return engine.generate(llm, prompts, params)  # request i is sampled by rank i % world

    before = sample(1)
    # one training step on the sampled tokens: each rank its rows, the denominator over all of them
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)  # the tiny presets' learning rate
    seqs = [p + c.token_ids for p, g in zip(prompts, before) for c in g]
    starts = [len(p) for p, g in zip(prompts, before) for _ in g]
    lens = [len(c.token_ids) for g in before for c in g]
    for micro in parallel.even(grpo.make_micro_batches(parallel.mine(range(len(seqs))), [len(s) for s in seqs], 256)):
        if not micro:
            parallel.idle_pass(model)
            continue
        ids = grpo.pad_batch([seqs[i] for i in micro], device)
        lp, _ = grpo.sequence_logprobs(model, ids, [starts[i] for i in micro], [lens[i] for i in micro], 1.0, 64)
        (-lp.sum() / sum(lens)).backward()
    optimizer.step()
    stale = sample(2)  # the engines still serve the old weights
    stale_gap = max(float((t - torch.tensor(c.logprobs)).abs().max()) for t, c in zip(
        trainer_logprobs(model, tok, prompts, stale, device), [c for g in stale for c in g]))
    engine.sync_weights(llm, model)
    after = sample(3)
    gaps = [0.0] * world  # per sampling rank: request i (both its completions) came from rank i % world
    trainer = trainer_logprobs(model, tok, prompts, after, device)
    for k, (t, c) in enumerate(zip(trainer, [c for g in after for c in g])):
        gaps[(k // 2) % world] = max(gaps[(k // 2) % world], float((t - torch.tensor(c.logprobs)).abs().max()))
    weights = {n: parallel.full(p.detach()).clone() for n, p in model.named_parameters()}
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        torch.save(weights, out_dir / "weights.pt")
        (out_dir / "result.json").write_text(json.dumps({
            "world": world, "completions": [[c.token_ids for c in g] for g in before],
            "logprobs": [[list(c.logprobs) for c in g] for g in before], "gap_per_rank": gaps, "stale_gap": stale_gap,
            "weights_read_by": readers}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
