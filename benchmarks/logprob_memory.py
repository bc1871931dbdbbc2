"""Peak memory of the log-probability computation for one long sequence: chunked (grpo.py) vs naive.

    python benchmarks/logprob_memory.py [--tokens 8192] [--vocab 32768] [--hidden 512]

Each variant runs forward + backward in a fresh process; the number is the growth of the process's peak
resident memory (VmHWM) over what it held before the computation. Naive = the full [tokens x vocab]
logits, then log_softmax and gather; chunked = grpo.sequence_logprobs with 1,024-position checkpointed
chunks; decoder_only = the decoder alone, the floor both share. Writes benchmarks/results/logprob_memory.json.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM")


def child(variant: str, tokens: int, vocab: int, hidden: int) -> None:
    sys.path.insert(0, str(ROOT))
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    import grpo

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
                      num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64, head_dim=64,
                      max_position_embeddings=tokens + 1, tie_word_embeddings=True)
    model = Qwen3ForCausalLM(cfg)
    ids = torch.randint(0, vocab, (1, tokens))
    starts, lengths = [1], [tokens - 1]
    # warm up allocator and kernels on a short sequence, then measure the long one
    grpo.sequence_logprobs(model, ids[:, :64], [1], [63], 1.0, 1024)[0].sum().backward()
    model.zero_grad(set_to_none=False)
    before = peak_rss_mib()
    if variant == "decoder_only":  # the shared part: no LM head at all
        lp = model.get_decoder()(input_ids=ids).last_hidden_state
    elif variant == "naive":
        logits = model(ids).logits.float()
        lp = torch.log_softmax(logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
    else:
        lp, _ = grpo.sequence_logprobs(model, ids, starts, lengths, 1.0, 1024)
    lp.sum().backward()
    print(json.dumps({"variant": variant, "peak_growth_mib": round(peak_rss_mib() - before, 1)}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a.child, a.tokens, a.vocab, a.hidden)
    result = {"tokens": a.tokens, "vocab": a.vocab, "hidden": a.hidden,
              "one_fp32_logits_tensor_mib": round(a.tokens * a.vocab * 4 / 2**20, 1)}
    for variant in ("decoder_only", "naive", "chunked"):
        out = subprocess.run([sys.executable, __file__, "--child", variant, "--tokens", str(a.tokens), "--vocab",
                              str(a.vocab), "--hidden", str(a.hidden)], capture_output=True, text=True, check=True)
        result[variant + "_peak_growth_mib"] = json.loads(out.stdout.strip().splitlines()[-1])["peak_growth_mib"]
    print(json.dumps(result, indent=2))
    path = Path(__file__).parent / "results" / "logprob_memory.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
